"""Every hint tfcli prints is a command that runs: the hints after each kind of run, after
`prepare`, and after an interrupted finetuning run, each run here as printed.

A hint's `<...>` placeholder (data only the user has) is filled with the test's data; training
commands get `--steps 2` so that they finish quickly (their flags and arguments are the hint's).
"""

from __future__ import annotations

import os
import shlex
import signal

import pytest

from .conftest import TINY_VIT, invoke, pretrained_run, tiny_npz

TINY_TEXT_MODELS = {
    "clm": {"family": "gpt", "n_layer": 1, "n_head": 2, "d_model": 32, "d_ff": 64, "max_seq_len": 48},
    "mlm": {"family": "bert", "n_layer": 1, "n_head": 2, "d_model": 32, "d_ff": 64, "max_seq_len": 64},
    "span": {"family": "t5", "n_layer": 1, "n_decoder_layer": 1, "n_head": 2, "d_model": 32, "d_ff": 64},
}


def hints(output: str) -> list[str]:
    """The commands in a run's closing lines ('label:  tfcli ...')."""
    tail = output.split("done.", 1)[-1]
    return [line[line.index("tfcli ") :].strip() for line in tail.splitlines() if "tfcli " in line]


def run_hint(hint: str, places: dict) -> None:
    for placeholder, value in places.items():
        hint = hint.replace(placeholder, str(value))
    assert "<" not in hint.replace("<extra_id_0>", ""), f"unfilled placeholder in {hint!r}"
    args = shlex.split(hint)[1:]
    if args[0] in ("pretrain", "finetune"):
        args += ["--steps", "2", "--quiet"]
    result = invoke(*args)
    assert result.exit_code == 0, (hint, result.output)


@pytest.mark.parametrize("objective", sorted(TINY_TEXT_MODELS))
def test_the_hints_after_a_text_pretraining_run_run(objective, tmp_path, small_text, mnli_dir, monkeypatch):
    monkeypatch.chdir(tmp_path)
    sections = {"mlm": {"documents": "paragraphs"}} if objective == "mlm" else {}
    run = pretrained_run(tmp_path, small_text, objective, TINY_TEXT_MODELS[objective], **sections)
    result = invoke("pretrain", "--resume", run, "--steps", 3)  # prints the closing lines again
    assert result.exit_code == 0, result.output
    found = hints(result.output)
    assert found, result.output
    for hint in found:
        run_hint(hint, {"<MNLI directory>": mnli_dir})


@pytest.mark.slow
def test_the_hints_after_mae_and_prepare_run(tmp_path, small_text, monkeypatch):
    monkeypatch.chdir(tmp_path)
    npz = tiny_npz(tmp_path / "images.npz", n=16, size=16)
    sets = [
        a
        for k, v in {
            **{f"model.{k}": v for k, v in TINY_VIT.items()},
            "train.eval_batches": 1,
            "train.batch_size": 8,
        }.items()
        for a in ("--set", f"{k}={v}")
    ]
    result = invoke("pretrain", "--objective", "mae", "--data", npz, "--steps", 2, "--out", tmp_path / "mae", *sets)
    assert result.exit_code == 0, result.output
    found = hints(result.output)
    assert len(found) == 2, result.output
    for hint in found:
        run_hint(hint, {})
    prepared = invoke("prepare", "--data", small_text, "--tokenizer", "gpt2", "--out", tmp_path / "store")
    assert prepared.exit_code == 0, prepared.output
    (hint,) = hints("done." + prepared.output)
    run_hint(hint + " --set model.n_layer=1 --batch-size 2", {})


def test_an_interrupted_finetuning_run_prints_a_resume_command_that_runs(hf_bert, mnli_dir, tmp_path, monkeypatch):
    """Ctrl-C during `finetune mnli`: a checkpoint, exit 130 and `tfcli finetune --resume RUN`, which
    continues the run (no task argument needed: the run knows its task)."""
    from tfcli.engine import trainer as training

    step = training.Trainer._train_step

    def interrupt_after_two(self):
        out = step(self)
        if self.step == 1:  # the step being finished is the second
            os.kill(os.getpid(), signal.SIGINT)
        return out

    monkeypatch.setattr(training.Trainer, "_train_step", interrupt_after_two)
    run = tmp_path / "ft"
    result = invoke(
        "finetune",
        "mnli",
        "--from",
        hf_bert,
        "--data",
        mnli_dir,
        "--steps",
        4,
        "--batch-size",
        4,
        "--out",
        run,
        "--quiet",
    )
    assert result.exit_code == 130, result.output
    line = next(line for line in result.output.splitlines() if "resume with" in line)
    hint = line[line.index("tfcli ") :]
    assert hint == f"tfcli finetune --resume {run}"
    monkeypatch.setattr(training.Trainer, "_train_step", step)
    resumed = invoke(*shlex.split(hint)[1:])
    assert resumed.exit_code == 0, resumed.output
    assert (run / "checkpoints" / "latest").read_text().strip() == "step-0000004"
