"""Benchmarks inside the training loop (train.eval_tasks, train.select_by): a short llama SFT run logs
val_piqa_acc and val_piqa_acc_norm at every evaluation, equal to `tfcli eval piqa` on the checkpoint
of that step; select_by picks the best checkpoint by the named metric; a resumed run logs exactly
what the uninterrupted one logged; bad settings are one line before anything is written."""

from __future__ import annotations

import json

import pytest

from .conftest import invoke, read_metrics, tiny_bert_recipe, train_losses, write_jsonl
from .test_bench import PIQA_ROWS
from .test_from_runs import ROWS
from .test_gguf import chat_gguf_file
from .test_resume_matrix import cut_and_resume


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    return chat_gguf_file(tmp_path_factory, max_seq_len=256)


@pytest.fixture(scope="module")
def bench_data(tmp_path_factory):
    """A directory holding a piqa directory, as train.eval_tasks_data may be."""
    root = tmp_path_factory.mktemp("benchdata")
    (root / "piqa").mkdir()
    rows = PIQA_ROWS * 3  # 9 questions
    (root / "piqa" / "valid.jsonl").write_text("".join(json.dumps(r) + "\n" for r, _ in rows))
    (root / "piqa" / "valid-labels.lst").write_text("".join(f"{y}\n" for _, y in rows))
    return root


def sft_args(chat_model, data, bench_data, *extra):
    return [
        "sft",
        "--from",
        chat_model,
        "--data",
        data,
        "--batch-size",
        4,
        "--lr",
        3e-3,
        *("--set", "train.log_interval=1", "--set", "train.eval_interval=2", "--set", "train.ckpt_interval=2"),
        *("--set", "train.keep_checkpoints=5", "--set", "sft.generate_limit=1", "--set", "sft.max_new_tokens=2"),
        *("--set", "train.eval_tasks=[piqa:6]", "--set", f"train.eval_tasks_data={bench_data}"),
        *extra,
    ]


@pytest.mark.slow  # the fast tier keeps this module's cheaper tests
def test_an_sft_run_logs_piqa_at_each_evaluation_and_selects_its_best_checkpoint_by_it(
    chat_model, bench_data, tmp_path
):
    data = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    run = tmp_path / "run"
    args = sft_args(chat_model, data, bench_data, "--set", "train.select_by=val_piqa_acc_norm")
    result = invoke("finetune", *args, "--steps", 4, "--out", run, "--quiet")
    assert result.exit_code == 0, result.output
    val = [m for m in read_metrics(run) if m.get("split") == "val"]
    assert [m["step"] for m in val] == [2, 4]
    assert all(0 <= m["piqa_acc"] <= 1 and 0 <= m["piqa_acc_norm"] <= 1 for m in val)
    best = max(val, key=lambda m: (m["piqa_acc_norm"], -m["step"]))  # the first of the highest
    assert (run / "checkpoints" / "best").read_text().strip() == f"step-{best['step']:07d}"
    listed = invoke("runs", tmp_path)  # the runs table shows the selecting metric at the chosen checkpoint
    assert listed.exit_code == 0 and f"{best['piqa_acc_norm']:.4f}" in listed.output.replace("\n", " ")
    assert "val_piqa_acc_norm" in listed.output.replace("│", "").replace("\n", "").replace(" ", "")
    for m in val:  # the loop's figure is tfcli eval's on that step's checkpoint (6 questions: 3 x 2 rows)
        out = tmp_path / f"eval-{m['step']}.json"
        step = run / "checkpoints" / f"step-{m['step']:07d}"
        scored = invoke("eval", "piqa", "--checkpoint", step, "--data", bench_data, "--limit", 6, "--out", out)
        assert scored.exit_code == 0, scored.output
        piqa = json.loads(out.read_text())["results"]["piqa"]
        assert piqa["acc_norm,none"] == pytest.approx(m["piqa_acc_norm"], abs=1e-6)
        assert piqa["acc,none"] == pytest.approx(m["piqa_acc"], abs=1e-6)


@pytest.mark.slow  # the fast tier keeps this module's cheaper tests
def test_select_by_a_loss_keeps_the_lowest(chat_model, bench_data, tmp_path):
    data = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    run = tmp_path / "run"
    args = sft_args(chat_model, data, bench_data, "--set", "train.select_by=val_loss")
    assert invoke("finetune", *args, "--steps", 4, "--out", run, "--quiet").exit_code == 0
    val = [m for m in read_metrics(run) if m.get("split") == "val"]
    lowest = min(val, key=lambda m: (m["loss"], m["step"]))
    assert (run / "checkpoints" / "best").read_text().strip() == f"step-{lowest['step']:07d}"


@pytest.mark.slow
def test_resume_logs_the_same_benchmark_figures_and_keeps_the_best(chat_model, bench_data, tmp_path):
    data = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    whole = tmp_path / "whole"
    args = sft_args(chat_model, data, bench_data, "--set", "train.select_by=val_piqa_acc_norm")
    assert invoke("finetune", *args, "--steps", 3, "--out", whole, "--quiet").exit_code == 0
    losses = cut_and_resume("finetune", whole, tmp_path)
    assert losses == train_losses(whole)
    val = lambda run: [m for m in read_metrics(run) if m.get("split") == "val"]  # noqa: E731
    assert val(tmp_path / "cut") == val(whole)
    assert (tmp_path / "cut" / "checkpoints" / "best").read_text() == (whole / "checkpoints" / "best").read_text()


@pytest.mark.parametrize(
    "setting, message",
    [
        ("train.select_by=val_piqa_f1", "train.select_by val_piqa_f1: this run logs val_loss"),
        ("train.eval_tasks=[hellaswag]", "unknown benchmark 'hellaswag'"),
        ("train.eval_tasks=[piqa:many]", "train.eval_tasks must be a list of benchmark[:questions]"),
        ("train.eval_tasks_data=", "piqa needs train.eval_tasks_data"),
    ],
)
def test_bad_benchmark_settings_are_one_line_before_the_run(setting, message, chat_model, bench_data, tmp_path):
    data = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    result = invoke("finetune", *sft_args(chat_model, data, bench_data, "--set", setting), "--out", tmp_path / "r")
    assert result.exit_code == 2 and message in result.output, result.output
    assert not (tmp_path / "r").exists()


def test_an_encoder_run_is_refused_benchmarks_in_one_line(small_text, bench_data, tmp_path, write_recipe):
    recipe = write_recipe(tiny_bert_recipe(small_text))
    args = ("--set", "train.eval_tasks=[piqa]", "--set", f"train.eval_tasks_data={bench_data}")
    result = invoke("pretrain", "--recipe", recipe, *args, "--out", tmp_path / "r")
    assert result.exit_code == 2 and "needs a decoder or an encoder-decoder" in result.output, result.output
    assert not (tmp_path / "r").exists()


def test_a_pretraining_run_logs_benchmarks_too(small_text, bench_data, tmp_path, write_recipe):
    from .conftest import tiny_gpt_recipe

    raw = tiny_gpt_recipe(small_text)
    raw["model"]["max_seq_len"] = 96
    recipe = write_recipe(raw)
    args = ("--set", "train.eval_tasks=[piqa:4]", "--set", f"train.eval_tasks_data={bench_data}")
    result = invoke("pretrain", "--recipe", recipe, *args, "--steps", 2, "--out", tmp_path / "r", "--quiet")
    assert result.exit_code == 0, result.output
    val = [m for m in read_metrics(tmp_path / "r") if m.get("split") == "val"]
    assert val and all({"loss", "piqa_acc", "piqa_acc_norm"} <= set(m) for m in val)


def test_a_benchmark_longer_than_the_model_is_refused_before_the_run(small_text, bench_data, tmp_path, write_recipe):
    from .conftest import tiny_gpt_recipe

    recipe = write_recipe(tiny_gpt_recipe(small_text))  # 32 positions: PIQA's questions are longer
    args = ("--set", "train.eval_tasks=[piqa:4]", "--set", f"train.eval_tasks_data={bench_data}")
    result = invoke("pretrain", "--recipe", recipe, *args, "--out", tmp_path / "r")
    assert result.exit_code == 2 and "train.eval_tasks: piqa: a question of" in result.output, result.output
    assert "does not fit the model's 32 positions" in result.output and not (tmp_path / "r").exists()
