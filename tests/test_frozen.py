"""Frozen models in a Job (a preference-tuning reference, a teacher): on the device, in eval mode, no
gradients, never optimised, never saved; the loss reads them. Shown with a distillation term added to
next-token pretraining: at step 1 the student is its frozen copy exactly, later it has moved away."""

from __future__ import annotations

import copy
import json

import torch
import torch.nn.functional as F

from tfcli import recipe as recipes
from tfcli.driver import RunRequest, train
from tfcli.engine import checkpoint
from tfcli.objectives.next_token import NextToken

from .conftest import read_metrics, tiny_gpt_recipe


def test_a_frozen_teacher_is_read_by_the_loss_and_never_trained_or_saved(tmp_path, small_text, monkeypatch):
    seen = {}
    setup = NextToken.setup

    def with_teacher(self, recipe, backbone):
        job = setup(self, recipe, backbone)
        teacher = copy.deepcopy(backbone.model).train()  # the trainer must put it in eval mode
        seen["before"] = {k: v.clone() for k, v in teacher.state_dict().items()}
        job.frozen["teacher"] = teacher
        own = job.loss

        def loss(model, heads, batch):
            value, metrics = own(model, heads, batch)
            with torch.no_grad():
                target = job.frozen["teacher"](batch["input_ids"])  # (B, T, D)
            seen["teacher"] = job.frozen["teacher"]
            distill = F.mse_loss(model(batch["input_ids"]), target)
            return value + distill, {**metrics, "distill": distill.detach()}

        job.loss = loss
        return job

    monkeypatch.setattr(NextToken, "setup", with_teacher)
    rec = recipes.from_dict(tiny_gpt_recipe(small_text, train={"steps": 6, "ckpt_interval": 6, "eval_interval": 6}))
    run, _ = train(RunRequest(rec, out=tmp_path / "run", quiet=True))
    teacher = seen["teacher"]
    assert not teacher.training and not any(p.requires_grad for p in teacher.parameters())
    assert all(torch.equal(v, seen["before"][k]) for k, v in teacher.state_dict().items())  # never optimised
    distill = {m["step"]: m["distill"] for m in read_metrics(run) if m.get("split") == "train"}
    assert distill[1] == 0.0 and distill[6] > 0.0  # the student starts as the teacher and moves away
    weights = checkpoint.load_weights(checkpoint.find(run))
    assert all(k.startswith(("model.", "heads.")) for k in weights)  # the teacher is not saved
    counts = json.loads((run / "run.json").read_text())["parameters"]
    assert counts["total"] == sum(p.numel() for p in teacher.parameters())  # nor counted as the run's
