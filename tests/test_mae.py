"""MAE objective: the loss counts masked patches only, norm_pix, training lowers it, CLI runs and resumes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tfcli import recipe as recipes
from tfcli.data.sampler import Sampler, sequential_batches
from tfcli.engine.runtime import Runtime
from tfcli.models.vit import MAEDecoder, ViT, ViTConfig, patchify, random_masking
from tfcli.objectives import mae
from tfcli.plugin import Backbone

from .conftest import TINY_VIT, invoke, mae_overrides, set_args, tiny_npz


@pytest.fixture(scope="module")
def npz(tmp_path_factory) -> Path:
    return tiny_npz(tmp_path_factory.mktemp("img") / "tiny.npz")


def objective_and_job(npz: Path):
    rec = recipes.load("mae-vit-tiny", mae_overrides(npz))
    torch.manual_seed(0)
    plugin = mae.MaskedAutoencoder(Runtime(torch.device("cpu")), quiet=True)
    backbone = Backbone(ViT(rec.model), None)
    return rec, backbone, plugin.setup(rec, backbone)


def test_loss_ignores_visible_patches():
    cfg = ViTConfig(**TINY_VIT)
    enc, heads = ViT(cfg), torch.nn.ModuleDict({"decoder": MAEDecoder(cfg)})
    x = torch.randn(2, 3, 16, 16)
    noise = torch.rand(2, 16)
    _, _, mask = random_masking(noise, 0.75)
    base, _ = mae.loss(enc, heads, {"pixels": x, "noise": noise})
    # predictions on visible patches do not count, whatever they are
    target = patchify(x, 4)
    pred = torch.randn_like(target)
    wild = pred + (1 - mask)[..., None] * 100.0
    assert torch.allclose(mae.masked_mse(pred, target, mask), mae.masked_mse(wild, target, mask))
    manual = ((pred - target) ** 2).mean(-1)[mask.bool()].mean()
    assert torch.allclose(mae.masked_mse(pred, target, mask), manual)
    # and the gradient w.r.t. the prediction is zero on visible patches
    pred.requires_grad_(True)
    mae.masked_mse(pred, target, mask).backward()
    assert pred.grad[~mask.bool()].abs().max() == 0 and pred.grad[mask.bool()].abs().max() > 0
    assert base.ndim == 0 and base > 0


def test_norm_pix_loss_normalises_each_target_patch():
    target = torch.randn(1, 4, 12) * 5 + 3
    mask = torch.ones(1, 4)
    t = (target - target.mean(-1, keepdim=True)) / (target.var(-1, keepdim=True) + 1e-6) ** 0.5
    assert mae.masked_mse(t, target, mask, norm_pix=True) < 1e-8
    assert mae.masked_mse(t, target, mask, norm_pix=False) > 1.0


def test_a_few_steps_lower_the_loss(npz):
    rec, backbone, job = objective_and_job(npz)
    batch = Sampler(job.train, 16, seed=0).next_batch()
    assert batch["noise"].shape == (16, 16)  # each image's masking noise comes with it
    params = list(backbone.model.parameters()) + list(job.heads.parameters())
    opt = torch.optim.AdamW(params, lr=3e-3)
    losses = []
    for _ in range(15):
        value, _ = job.loss(backbone.model, job.heads, batch)
        losses.append(float(value.detach()))
        value.backward()
        opt.step()
        opt.zero_grad()
    assert losses[-1] < 0.6 * losses[0], losses


def test_held_out_batches_are_the_same_every_time(npz):
    _, _, job = objective_and_job(npz)
    a, b = list(sequential_batches(job.val, 16, seed=0, max_batches=1)), list(sequential_batches(job.val, 16, 0, 1))
    assert len(a) == 1 and a[0]["pixels"].shape == (16, 3, 16, 16)
    assert torch.equal(a[0]["noise"], b[0]["noise"]) and torch.equal(a[0]["pixels"], b[0]["pixels"])


def test_cli_pretrain_mae_runs_saves_pictures_and_resumes(npz, tmp_path):
    from PIL import Image

    out = tmp_path / "run"
    result = invoke("pretrain", "--objective", "mae", "--out", out, "--quiet", *set_args(mae_overrides(npz)))
    assert result.exit_code == 0, result.output
    assert "tfcli eval mae --checkpoint" in result.output
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r.get("split") == "train"]
    assert [r["step"] for r in train] == [2, 4] and all(np.isfinite(r["loss"]) for r in train)
    assert "img_per_s" in train[0]
    assert sorted(p.name for p in (out / "recon").glob("*.png")) == ["eval-001.png", "eval-002.png"]
    with Image.open(out / "recon.png") as im:
        assert im.size[0] > im.size[1] / 16 * 2  # three columns
    assert not (out / "tokenizer.json").exists()
    # resume continues from step 4 to 6
    result = invoke("pretrain", "--resume", out, "--steps", 6, "--quiet")
    assert result.exit_code == 0, result.output
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1] == 6
    # a checkpoint of the wrong family is one line naming it, exit code 2
    result = invoke("generate", "--checkpoint", out, "--prompt", "hi")
    assert result.exit_code == 2 and result.output.count("\n") == 1
    assert (
        "holds a 'vit' model; generate needs a decoder (gpt, llama, vlm, generic) or encoder-decoder (t5)"
        in result.output
    )
    # tfcli eval mae: held-out reconstruction loss and the picture grid; the run's recon.png is left alone
    before = (out / "recon.png").read_bytes()
    png = tmp_path / "recon.png"
    result = invoke("eval", "mae", "--checkpoint", out, "--out", png)
    assert result.exit_code == 0, result.output
    assert "recon_loss" in result.output and "images" in result.output
    with Image.open(png) as im:
        assert im.size == (3 * (96 + 2) + 2, 8 * (96 + 2) + 2)  # 3 columns x 8 held-out images, 16px x6
    # plain `tfcli eval` is the run's own objective's evaluation
    result = invoke("eval", "--checkpoint", out)
    assert result.exit_code == 0 and "recon_loss" in result.output, result.output
    assert (out / "recon.png").read_bytes() == before and (out / "recon-eval.png").is_file()


def test_reconstruction_picture_pastes_visible_patches():
    from tfcli.objectives.mae_pictures import reconstruct

    cfg = ViTConfig(**TINY_VIT)
    enc, dec = ViT(cfg).eval(), MAEDecoder(cfg).eval()
    x = torch.rand(2, 3, 16, 16)
    noise = torch.rand(2, 16)
    _, _, mask = random_masking(noise, 0.75)
    original, masked, recon = reconstruct(enc, dec, x, noise, lambda t: t.clamp(0, 1))
    vis = (1 - mask).bool()
    p_orig, p_masked, p_recon = (patchify(t, 4) for t in (original, masked, recon))
    assert torch.allclose(p_recon[vis], p_orig[vis]) and torch.allclose(p_masked[vis], p_orig[vis])
    assert torch.all(p_masked[mask.bool()] == 0.5)
    assert not torch.allclose(p_recon[mask.bool()], p_orig[mask.bool()])


def test_eval_mae_of_a_missing_run_is_one_line(tmp_path):
    result = invoke("eval", "mae", "--checkpoint", tmp_path / "missing")
    assert result.exit_code == 2 and "not found" in result.output


def test_objective_family_mismatch_is_a_user_error():
    result = invoke("pretrain", "--objective", "mae", "--recipe", "gpt-mini", "--steps", 1)
    assert result.exit_code == 2 and "describes a 'gpt' model; objective 'mae' trains 'vit'" in result.output
