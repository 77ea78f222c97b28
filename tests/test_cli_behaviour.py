"""What a new user met on the command line (issue 22): resume overrides, dev-only evaluation data,
`--train head` on decoders, the newest run that can generate, few-shot that does not fit, checks
before data is read, warmup longer than the run, capped lists in errors."""
from __future__ import annotations

import json

import yaml

from .conftest import invoke, read_metrics, tiny_gpt_recipe


def gpt_run(tmp_path, small_text, name="run", **train):
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(yaml.safe_dump(tiny_gpt_recipe(small_text, train={"steps": 4, "eval_interval": 4,
                                                                        "ckpt_interval": 2, **train})))
    result = invoke("pretrain", "--recipe", recipe, "--out", tmp_path / name, "--quiet")
    assert result.exit_code == 0, result.output
    return tmp_path / name


def test_resume_refuses_an_override_that_would_not_be_what_ran(tmp_path, small_text):
    run = gpt_run(tmp_path, small_text)
    before = (run / "config.yaml").read_text()
    result = invoke("pretrain", "--resume", run, "--lr", 0.5)
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        f"error: --resume {run}: optim.lr was 0.003 and cannot change when resuming; a resumed run continues its "
        f"saved optimizer, schedule and data (it may change train.steps, intervals, device and threads); start a new "
        f"run for optim.lr=0.5"]
    assert (run / "config.yaml").read_text() == before
    longer = invoke("pretrain", "--resume", run, "--steps", 6, "--quiet")  # training longer is what resume is for
    assert longer.exit_code == 0, longer.output
    assert max(m["step"] for m in read_metrics(run)) == 6
