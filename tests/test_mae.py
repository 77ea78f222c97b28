"""MAE objective: the loss counts masked patches only, norm_pix, training lowers it, CLI runs and resumes."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from tfcli import recipe as recipes
from tfcli.cli import app
from tfcli.models.vit import MAEDecoder, ViT, ViTConfig, patchify, random_masking
from tfcli.objectives import mae

TINY = {"image_size": 16, "patch_size": 4, "n_layer": 2, "n_head": 2, "d_model": 32, "d_ff": 64,
        "decoder_d_model": 32, "decoder_n_layer": 1, "decoder_n_head": 2, "decoder_d_ff": 64}


def tiny_npz(path: Path, n: int = 96, size: int = 16) -> Path:
    """Smooth random gradients, tinted by class (0 red, 1 blue), as x_train/y_train/x_test/y_test."""
    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:size, 0:size] / size
    def make(k):
        imgs, labels = [], []
        for i in range(k):
            c = rng.uniform(0, 1, (3, 3))
            img = c[:, 0, None, None] + c[:, 1, None, None] * xx + c[:, 2, None, None] * yy
            img[2 * (i % 2)] += 1.0  # class 0 reddish, class 1 bluish
            imgs.append((np.clip(img / 3.5, 0, 1).transpose(1, 2, 0) * 255).astype(np.uint8))
            labels.append(i % 2)
        return np.stack(imgs), np.array(labels)
    xtr, ytr = make(n)
    xte, yte = make(16)
    np.savez(path, x_train=xtr, y_train=ytr, x_test=xte, y_test=yte, class_names=np.array(["a", "b"]))
    return path


@pytest.fixture(scope="module")
def npz(tmp_path_factory) -> Path:
    return tiny_npz(tmp_path_factory.mktemp("img") / "tiny.npz")


def overrides(npz: Path, **extra) -> dict:
    o = {f"model.{k}": v for k, v in TINY.items()}
    o.update({"data.source": str(npz), "train.batch_size": 16, "train.steps": 4, "train.log_interval": 2,
              "train.eval_interval": 2, "train.eval_batches": 1, "train.ckpt_interval": 2,
              "schedule.warmup_steps": 1, "train.threads": 2, "images.crop_scale": [0.5, 1.0]})
    o.update(extra)
    return o


def test_loss_ignores_visible_patches():
    cfg = ViTConfig(**TINY)
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
    torch.manual_seed(0)
    rec = recipes.load("mae-vit-tiny", overrides(npz))
    enc = ViT(rec.model)
    prepared = mae.prepare(rec, None, None, enc)
    batch = prepared.train.next_batch()
    batch["noise"] = torch.rand(16, 16)
    params = list(enc.parameters()) + list(prepared.heads.parameters())
    opt = torch.optim.AdamW(params, lr=3e-3)
    losses = []
    for _ in range(15):
        value, _ = prepared.loss(enc, prepared.heads, batch)
        losses.append(float(value.detach()))
        value.backward()
        opt.step()
        opt.zero_grad()
    assert losses[-1] < 0.6 * losses[0], losses


def test_held_out_batches_are_the_same_every_time(npz):
    rec = recipes.load("mae-vit-tiny", overrides(npz))
    prepared = mae.prepare(rec, None, None, ViT(rec.model))
    a, b = list(prepared.val()), list(prepared.val())
    assert len(a) == 1 and a[0]["pixels"].shape == (16, 3, 16, 16)
    assert torch.equal(a[0]["noise"], b[0]["noise"]) and torch.equal(a[0]["pixels"], b[0]["pixels"])


def test_cli_pretrain_mae_runs_saves_pictures_and_resumes(npz, tmp_path):
    out = tmp_path / "run"
    args = ["pretrain", "--objective", "mae", "--out", str(out), "--quiet"]
    for k, v in overrides(npz).items():
        args += ["--set", f"{k}={json.dumps(v) if isinstance(v, list) else v}"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "tfcli eval mae --checkpoint" in result.output
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "split" not in r]
    assert [r["step"] for r in train] == [2, 4] and all(np.isfinite(r["loss"]) for r in train)
    assert "img_per_s" in train[0]
    assert sorted(p.name for p in (out / "recon").glob("*.png")) == ["eval-001.png", "eval-002.png"]
    from PIL import Image
    with Image.open(out / "recon.png") as im:
        assert im.size[0] > im.size[1] / 16 * 2  # three columns
    assert not (out / "tokenizer.json").exists()
    # resume continues from step 4 to 6
    result = CliRunner().invoke(app, ["pretrain", "--resume", str(out), "--steps", "6", "--quiet"])
    assert result.exit_code == 0, result.output
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1] == 6
    # a checkpoint of the wrong family is one line naming it, exit code 2
    result = CliRunner().invoke(app, ["generate", "--checkpoint", str(out), "--prompt", "hi"])
    assert result.exit_code == 2 and result.output.count("\n") == 1
    assert "holds a 'vit' model; generate needs a decoder (gpt) or encoder-decoder (t5)" in result.output
    # tfcli eval mae: held-out reconstruction loss and the picture grid
    png = tmp_path / "recon.png"
    result = CliRunner().invoke(app, ["eval", "mae", "--checkpoint", str(out), "--out", str(png)])
    assert result.exit_code == 0, result.output
    assert "recon_loss" in result.output and "images" in result.output
    with Image.open(png) as im:
        assert im.size == (3 * (96 + 2) + 2, 8 * (96 + 2) + 2)  # 3 columns x 8 held-out images, 16px x6
    # plain `tfcli eval` gives the held-out loss of the pretraining run
    result = CliRunner().invoke(app, ["eval", "--checkpoint", str(out)])
    assert result.exit_code == 0 and "loss" in result.output, result.output


def test_reconstruction_picture_pastes_visible_patches():
    from tfcli.pictures import reconstruct
    cfg = ViTConfig(**TINY)
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


def test_eval_mae_rejects_other_runs(tmp_path):
    result = CliRunner().invoke(app, ["eval", "mae", "--checkpoint", str(tmp_path / "missing")])
    assert result.exit_code == 2 and "not found" in result.output


def test_objective_family_mismatch_is_a_user_error(tmp_path):
    result = CliRunner().invoke(app, ["pretrain", "--objective", "mae", "--recipe", "gpt-mini", "--steps", "1"])
    assert result.exit_code == 2 and "trains a 'vit' model" in result.output
