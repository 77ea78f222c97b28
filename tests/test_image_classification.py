"""image-classify: linear probe keeps the MAE encoder frozen, full finetuning trains it, accuracy and
confusion matrix on the test split, errors for unlabelled data and wrong pooling."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from tfcli import checkpoint
from tfcli.cli import app
from tfcli.tasks import image_classification as ic

from .test_mae import TINY, overrides, tiny_npz

FT = ["--steps", "6", "--batch-size", "16", "--set", "train.eval_interval=3", "--set", "train.log_interval=3",
      "--set", "train.ckpt_interval=3", "--set", "schedule.warmup_steps=1", "--set", "train.threads=2",
      "--quiet"]


@pytest.fixture(scope="module")
def mae_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("ic")
    npz = tiny_npz(root / "tiny.npz")
    out = root / "mae"
    args = ["pretrain", "--objective", "mae", "--out", str(out), "--quiet"]
    for k, v in overrides(npz, **{"train.steps": 2}).items():
        args += ["--set", f"{k}={json.dumps(v) if isinstance(v, list) else v}"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    return out, npz


def _encoder_weights(run):
    w = checkpoint.load_weights(checkpoint.find(run))
    return {k: v for k, v in w.items() if k.startswith("model.")}


@pytest.mark.parametrize("train,pooling", [("head", "cls"), ("all", "mean")])
def test_finetune_from_mae_run(mae_run, tmp_path, train, pooling):
    run, npz = mae_run
    out = tmp_path / f"ft-{train}"
    result = CliRunner().invoke(app, ["finetune", "image-classify", "--from", str(run), "--data", str(npz),
                                      "--train", train, "--pooling", pooling, "--out", str(out), *FT])
    assert result.exit_code == 0, result.output
    before, after = _encoder_weights(run), _encoder_weights(out)
    assert before.keys() == after.keys()
    same = all(torch.equal(before[k], after[k]) for k in before)
    assert same == (train == "head")  # a linear probe leaves the encoder exactly as pretrained
    report = json.loads((out / "eval.json").read_text())["test"]
    assert np.array(report["confusion"]).sum() == 16 and 0.0 <= report["acc"] <= 1.0
    assert json.loads((out / "classes.json").read_text()) == ["a", "b"]
    result = CliRunner().invoke(app, ["eval", "image-classify", "--checkpoint", str(out)])
    assert result.exit_code == 0 and "confusion matrix" in result.output, result.output


def test_linear_probe_learns_a_separable_task(mae_run):
    """A linear head on a random encoder separates red from blue images within a few dozen steps."""
    from tfcli import recipe as recipes
    from tfcli.data.image_batches import ImageSampler, ImageTransform

    _, npz = mae_run
    rec = recipes.load("vit-tiny-image-classify", {**{f"model.{k}": v for k, v in TINY.items()},
                                                  "data.source": str(npz)})
    model = ic.load_encoder(rec, None).requires_grad_(False)
    splits = ic.load_labelled(rec)
    heads = ic.build_head(model.cfg.d_model, 2)
    opt = torch.optim.AdamW(heads.parameters(), lr=3e-2)
    sampler = ImageSampler(splits.train, ImageTransform.from_recipe(rec, train=False), 32, 0)
    loss_fn = ic.make_loss("cls")
    for _ in range(40):
        value, _ = loss_fn(model, heads, sampler.next_batch())
        value.backward()
        opt.step()
        opt.zero_grad()
    pred = ic.predict(model, heads, splits.test, ImageTransform.from_recipe(rec, train=False), "cls")
    assert (pred == splits.test.labels).mean() >= 0.9


def test_unlabelled_data_and_bad_pooling_are_user_errors(tmp_path):
    np.savez(tmp_path / "u.npz", x_train=np.zeros((4, 16, 16, 3), np.uint8))
    set_tiny = [x for k, v in TINY.items() for x in ("--set", f"model.{k}={v}")]
    result = CliRunner().invoke(app, ["finetune", "image-classify", "--data", str(tmp_path / "u.npz"), *set_tiny, *FT])
    assert result.exit_code == 2 and "without labels" in result.output
    result = CliRunner().invoke(app, ["finetune", "image-classify", "--pooling", "last4-sum", *set_tiny, *FT])
    assert result.exit_code == 2 and "pools the 'cls'" in result.output
