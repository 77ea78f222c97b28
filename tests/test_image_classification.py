"""image-classify: linear probe keeps the MAE encoder frozen, full finetuning trains it, accuracy and
confusion matrix on the test split, errors for unlabelled data and wrong pooling."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tfcli import recipe as recipes
from tfcli.data.sampler import Sampler
from tfcli.engine import checkpoint
from tfcli.engine.runtime import Runtime
from tfcli.engine.trainer import ObjectiveModule
from tfcli.models.vit import ViT
from tfcli.plugin import Backbone
from tfcli.tasks.classification import predict
from tfcli.tasks.image_classification import ImageClassify

from .conftest import TINY_VIT, invoke, mae_overrides, set_args, tiny_npz

FT = [
    "--steps",
    "6",
    "--batch-size",
    "16",
    "--set",
    "train.eval_interval=3",
    "--set",
    "train.log_interval=3",
    "--set",
    "train.ckpt_interval=3",
    "--set",
    "schedule.warmup_steps=1",
    "--set",
    "train.threads=1",  # one core a worker (conftest.mae_overrides)
    "--quiet",
]


@pytest.fixture(scope="module")
def mae_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("ic")
    npz = tiny_npz(root / "tiny.npz")
    out = root / "mae"
    result = invoke(
        "pretrain", "--objective", "mae", "--out", out, "--quiet", *set_args(mae_overrides(npz, **{"train.steps": 2}))
    )
    assert result.exit_code == 0, result.output
    return out, npz


def _encoder_weights(run):
    """The encoder a run holds (a head-only run's is its base's, read again)."""
    from tfcli.engine.backbone import from_run

    return from_run(run).model.state_dict()


@pytest.mark.parametrize("train,pooling", [("head", "cls"), ("all", "mean")])
def test_finetune_from_mae_run(mae_run, tmp_path, train, pooling):
    run, npz = mae_run
    out = tmp_path / f"ft-{train}"
    result = invoke(
        "finetune",
        "image-classify",
        "--from",
        run,
        "--data",
        npz,
        "--train",
        train,
        "--pooling",
        pooling,
        "--out",
        out,
        *FT,
    )
    assert result.exit_code == 0, result.output
    before, after = _encoder_weights(run), _encoder_weights(out)
    assert before.keys() == after.keys()
    saved = checkpoint.load_weights(checkpoint.find(out))
    assert (train == "head") == all(k.startswith("heads.") for k in saved)  # a probe saves only its head
    same = all(torch.equal(before[k], after[k]) for k in before)
    assert same == (train == "head")  # a linear probe leaves the encoder exactly as pretrained
    report = json.loads((out / "eval.json").read_text())["test"]
    assert np.array(report["confusion"]).sum() == 16 and 0.0 <= report["acc"] <= 1.0
    assert json.loads((out / "labels.json").read_text()) == ["a", "b"]
    mae_cfg = recipes.load_resolved(run / "config.yaml").settings
    assert recipes.load_resolved(out / "config.yaml").settings.mean == mae_cfg.mean  # the pretrained normalisation
    result = invoke("eval", "image-classify", "--checkpoint", out)
    assert result.exit_code == 0 and "confusion matrix" in result.output, result.output
    assert (out / "eval-image-classify.json").is_file()


def test_linear_probe_learns_a_separable_task(mae_run):
    """A linear head on a random encoder separates red from blue images within a few dozen steps."""
    _, npz = mae_run
    rec = recipes.load(
        "vit-tiny-image-classify",
        {**{f"model.{k}": v for k, v in TINY_VIT.items()}, "data.source": str(npz), "image-classify.augment": False},
    )
    task = ImageClassify(Runtime(torch.device("cpu")), quiet=True)
    torch.manual_seed(0)
    backbone = Backbone(ViT(rec.model).requires_grad_(False), None)
    data = task.load(rec, backbone)
    head = task.head(rec, backbone, data)
    module = ObjectiveModule(backbone.model, head.heads, head.loss)
    opt = torch.optim.AdamW(head.heads.parameters(), lr=3e-2)
    sampler = Sampler(head.source(data.train, train=True), 32, seed=0)
    for _ in range(40):
        value, _ = module(sampler.next_batch())
        value.backward()
        opt.step()
        opt.zero_grad()
    scores, gold = predict(module, head, head.source(data.evals["test"], train=False), 64, torch.device("cpu"))
    assert (scores.argmax(1) == gold).mean() >= 0.9


def test_unlabelled_data_and_bad_pooling_are_user_errors(tmp_path):
    np.savez(tmp_path / "u.npz", x_train=np.zeros((4, 16, 16, 3), np.uint8))
    set_tiny = [x for k, v in TINY_VIT.items() for x in ("--set", f"model.{k}={v}")]
    result = invoke("finetune", "image-classify", "--data", tmp_path / "u.npz", *set_tiny, *FT)
    assert result.exit_code == 2 and "without labels" in result.output
    result = invoke("finetune", "image-classify", "--pooling", "last4-sum", *set_tiny, *FT)
    assert result.exit_code == 2 and "a vit classifier pools cls, mean" in result.output
