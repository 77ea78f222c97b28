"""engine/trainer.py: learning, exact resume, accumulation, the schedule, batches built ahead, time limits."""

from __future__ import annotations

import shutil
import time

import pytest
import torch

from tfcli import recipe as recipes
from tfcli.driver import RunRequest, train
from tfcli.engine import checkpoint
from tfcli.engine.trainer import _Window, lr_multiplier
from tfcli.recipe import ScheduleConfig

from .conftest import DEVICE, read_metrics, tiny_bert_recipe, tiny_gpt_recipe, train_losses


def pretrain(recipe, out=None, resume=None, quiet=True):
    return train(RunRequest(recipe, out=out, resume=resume, quiet=quiet))[0]


def test_loss_falls_and_checkpoints_are_complete(tmp_path, small_text):
    rec = recipes.from_dict(tiny_gpt_recipe(small_text, train={"steps": 40, "ckpt_interval": 20, "eval_interval": 20}))
    run = pretrain(rec, out=tmp_path / "run", quiet=True)
    losses = train_losses(run)
    first, last = list(losses.values())[:5], list(losses.values())[-5:]
    assert sum(last) / 5 < sum(first) / 5 - 0.5  # from ~4.1 (uniform over ~60 chars) well into learning
    val = [m for m in read_metrics(run) if m.get("split") == "val"]
    assert [m["step"] for m in val] == [20, 40] and val[1]["loss"] < val[0]["loss"]
    assert val[1]["ppl"] == pytest.approx(2.718281828 ** val[1]["loss"], rel=1e-4)
    ckpt = checkpoint.find(run)
    assert ckpt.name == "step-0000040"
    assert {p.name for p in ckpt.iterdir()} == {"model.safetensors", "state.safetensors", "state.json", "meta.json"}
    assert (run / "config.yaml").is_file() and (run / "tokenizer.json").is_file()
    assert recipes.load_resolved(run / "config.yaml").model.vocab_size > 0


def test_throughput_leaves_out_evaluations_but_not_training_time():
    after_log = _Window()
    with after_log.excluding():  # an evaluation right after a log line, before the window's first step
        time.sleep(0.05)
    after_log.begin()
    time.sleep(0.02)
    assert after_log.seconds() >= 0.02  # the evaluation was not subtracted from the steps' time
    within = _Window()
    within.begin()
    with within.excluding():
        time.sleep(0.05)
    assert within.seconds() < 0.05


@pytest.mark.parametrize("prefetch", [0, 3])
def test_resume_gives_the_same_losses_as_an_uninterrupted_run(tmp_path, small_text, prefetch):
    train = {"steps": 20, "ckpt_interval": 10, "prefetch": prefetch, "deterministic": True}  # on a GPU too
    rec = recipes.from_dict(tiny_gpt_recipe(small_text, train=train))
    whole = pretrain(rec, out=tmp_path / "whole", quiet=True)
    # a run that died right after its step-10 checkpoint: same directory, nothing after step 10
    crashed = tmp_path / "crashed"
    shutil.copytree(whole, crashed)
    shutil.rmtree(crashed / "checkpoints" / "step-0000020")
    (crashed / "checkpoints" / "latest").write_text("step-0000010")
    lines = (crashed / "metrics.jsonl").read_text().splitlines()
    (crashed / "metrics.jsonl").write_text(
        "\n".join(l for l in lines if '"step": 1,' in l or int(l.split('"step": ')[1].split(",")[0]) <= 10) + "\n"
    )
    resumed = recipes.load_resolved(crashed / "config.yaml")
    pretrain(resumed, resume=crashed, quiet=True)
    a, b = train_losses(whole), train_losses(crashed)
    assert sorted(b) == list(range(1, 21))
    assert [b[s] for s in range(11, 21)] == [a[s] for s in range(11, 21)]  # bit for bit


@pytest.mark.parametrize("make", [tiny_gpt_recipe, tiny_bert_recipe], ids=["clm", "mlm"])
def test_batches_built_ahead_are_the_batches_built_in_line(tmp_path, small_text, make):
    """train.prefetch builds batches in a thread (on a GPU into pinned memory); MLM masking included,
    they are the same batches."""
    runs = {}
    for prefetch in (0, 2):
        raw = make(small_text)
        raw["train"].update(steps=12, log_interval=1, prefetch=prefetch, deterministic=True)
        runs[prefetch] = train_losses(pretrain(recipes.from_dict(raw), out=tmp_path / f"p{prefetch}"))
    assert len(runs[0]) == 12 and runs[0] == runs[2]  # bit for bit


@pytest.mark.slow  # compilation: test_compile.py (slow) compiles every shipped recipe
def test_compiled_and_eager_losses_agree(tmp_path, small_text):
    try:
        torch.compile(lambda x: x * 2)(torch.ones(2))
    except Exception as e:  # no C compiler, unsupported Python: compile is unavailable here
        pytest.skip(f"torch.compile unavailable: {e}")
    losses = {}
    for setting in ("off", "on"):
        raw = tiny_gpt_recipe(
            small_text, train={"steps": 4, "compile": setting, "eval_interval": 4, "ckpt_interval": 4}
        )
        losses[setting] = train_losses(pretrain(recipes.from_dict(raw), out=tmp_path / setting))
    assert len(losses["on"]) == 4
    close = 1e-5 if DEVICE == "cpu" else 1e-3  # a GPU trains in bf16, which inductor's fusions round apart
    assert all(abs(losses["on"][s] - losses["off"][s]) < close for s in losses["off"]), losses


def test_gradient_accumulation_matches_one_big_batch(tmp_path, small_text):
    """On the CPU in fp32, where only the summation order differs (a GPU's bf16 rounds each micro-batch)."""
    big = recipes.from_dict(tiny_gpt_recipe(small_text, train={"steps": 6, "batch_size": 8, "device": "cpu"}))
    acc = recipes.from_dict(
        tiny_gpt_recipe(small_text, train={"steps": 6, "batch_size": 4, "grad_accum": 2, "device": "cpu"})
    )
    a = train_losses(pretrain(big, out=tmp_path / "big", quiet=True))
    b = train_losses(pretrain(acc, out=tmp_path / "acc", quiet=True))
    assert all(abs(a[s] - b[s]) < 1e-5 for s in a)


def test_schedule_warms_up_then_decays_to_the_minimum():
    sched = ScheduleConfig(warmup_steps=10, decay="cosine", min_lr=1e-4)
    m = [lr_multiplier(s, sched, total=100, base_lr=1e-3) for s in range(101)]
    assert m[0] == pytest.approx(0.1) and m[9] == pytest.approx(1.0)
    assert all(x >= y for x, y in zip(m[10:], m[11:]))
    assert m[100] == pytest.approx(0.1)  # min_lr / lr
    linear = ScheduleConfig(warmup_steps=0, decay="linear", min_lr=0.0)
    assert lr_multiplier(50, linear, total=100, base_lr=1.0) == pytest.approx(0.5)


def test_a_time_limit_stops_the_run_evaluated_and_checkpointed(tmp_path, small_text):
    rec = recipes.from_dict(tiny_gpt_recipe(small_text, train={"steps": 500, "max_time": 1e-9, "log_interval": 50}))
    run = pretrain(rec, out=tmp_path / "run", quiet=True)
    rows = read_metrics(run)
    assert [r["split"] for r in rows] == ["train", "val", "stopped"] and rows[-1]["step"] == 1
    assert checkpoint.find(run).name == "step-0000001"
    assert rows[0]["peak_mem_mb"] > 50  # a Python process with torch holds well over 50 MB


def test_the_first_log_line_after_a_resume_averages_its_whole_interval(tmp_path, small_text):
    """Logged every 4 steps, checkpointed every 2: resumed from step 6, the step-8 line averages steps
    5-8 (two of them from before the resume) exactly as the uninterrupted run's, throughput too."""
    raw = tiny_gpt_recipe(small_text, train={"steps": 8, "log_interval": 4, "ckpt_interval": 2, "eval_interval": 8})
    whole = pretrain(recipes.from_dict(raw), out=tmp_path / "whole")
    cut = tmp_path / "cut"
    shutil.copytree(whole, cut)
    shutil.rmtree(cut / "checkpoints" / "step-0000008")
    (cut / "checkpoints" / "latest").write_text("step-0000006")
    pretrain(recipes.load_resolved(cut / "config.yaml"), resume=cut)
    a, b = ({m["step"]: m for m in read_metrics(run) if m.get("split") == "train"} for run in (whole, cut))
    assert sorted(a) == sorted(b) == [4, 8]
    assert a[8]["loss"] == b[8]["loss"] and a[8]["grad_norm"] == b[8]["grad_norm"]
    assert b[8]["tok_per_s"] < 10 * a[8]["tok_per_s"]  # 4 steps' tokens over 4 steps' time, not over 2
