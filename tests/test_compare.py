"""`tfcli compare`: budgets and cell names; a grid of two approaches writes its table, CSV and chart;
run again, a half-finished grid runs only what is missing (a finished cell is not run again, an
interrupted one resumes from its checkpoint)."""

from __future__ import annotations

import csv
import json
import shutil

import pytest
import yaml

from tfcli.commands import compare
from tfcli.errors import UserError

from .conftest import invoke, write_jsonl


@pytest.mark.parametrize(
    "text, kind, amount",
    [
        ("500steps", "steps", 500),
        ("10000ex", "examples", 10000),
        ("10m", "minutes", 10),
        ("1.5h", "minutes", 90),
        ("2epochs", "epochs", 2),
    ],
)
def test_budgets(text, kind, amount):
    assert compare.parse_budget(text) == compare.Budget(kind, amount)


@pytest.mark.parametrize("text", ["10", "fast", "0steps", "-3m"])
def test_a_bad_budget_is_one_line(text):
    with pytest.raises(UserError, match="--budget"):
        compare.parse_budget(text)


def test_cell_names_are_unique_and_readable():
    names = compare.unique_slugs(["runs/a/bert", "runs/b/bert", "hf/minilm"])
    assert names == {"runs/a/bert": "a-bert", "runs/b/bert": "b-bert", "hf/minilm": "hf-minilm"}


def test_unknown_approaches_and_missing_tasks_are_refused():
    with pytest.raises(UserError, match="unknown approach 'prefix'"):
        compare.load_grid(None, "mnli", "x", "all,prefix", None, None, None, [])
    with pytest.raises(UserError, match="name the task"):
        compare.load_grid(None, None, "x", "all", None, None, None, [])


def test_a_model_setting_is_refused_before_any_cell_runs():
    """Every cell's model comes whole from its --from source (finetune --from refuses model.*): a grid
    that sets or varies one would fail in every cell's process; it is refused at once instead."""
    with pytest.raises(UserError, match="compare: model.dropout: each cell's model comes from its --from"):
        compare.load_grid(None, "mnli", "x", "all", None, None, None, ["model.dropout=0.1"])
    with pytest.raises(UserError, match="compare: model.n_layer: each cell's model comes from its --from"):
        compare.load_grid(None, "mnli", "x", "all", None, None, None, [], vary=["model.n_layer=1,2"])


def study(hf_bert, mnli_dir, out):
    return invoke(
        "compare",
        "--task",
        "mnli",
        "--from",
        hf_bert,
        "--train",
        "head,lora",
        "--budget",
        "4steps",
        "--data",
        mnli_dir,
        "--lr",
        "head=1e-3",
        "--out",
        out,
        "--set",
        "train.batch_size=4",
        "--set",
        "train.ckpt_interval=2",
        "--set",
        "train.keep_checkpoints=5",
        "--set",
        "finetune.eval_limit=6",
    )


@pytest.mark.slow
def test_compare_tabulates_a_grid_and_finishes_a_half_finished_one(hf_bert, mnli_dir, tmp_path):
    out = tmp_path / "study"
    result = study(hf_bert, mnli_dir, out)
    assert result.exit_code == 0, result.output
    rows = list(csv.DictReader(open(out / "results.csv")))
    assert [r["train"] for r in rows] == ["head", "lora"] and all(r["status"] == "done" for r in rows)
    head, lora = rows
    assert 0 < int(head["trained_params"]) < int(lora["trained_params"]) < int(lora["total_params"])
    assert float(head["peak_mem_mb"]) > 0 and float(lora["dev_matched_acc"]) >= 0
    assert (out / "results.png").stat().st_size > 0 and "| lora |" in (out / "results.md").read_text()

    # half-finished: the lora cell interrupted after its step-2 checkpoint; the head cell done
    lora_run = next((out / "cells").glob("*-lora"))
    (lora_run / "eval.json").unlink()
    shutil.rmtree(lora_run / "checkpoints" / "step-0000004")
    (lora_run / "checkpoints" / "latest").write_text("step-0000002")
    (lora_run / "checkpoints" / "best").write_text("step-0000002")
    head_eval = next((out / "cells").glob("*-head")) / "eval.json"
    before = head_eval.stat().st_mtime_ns
    result = study(hf_bert, mnli_dir, out)
    assert result.exit_code == 0, result.output
    assert head_eval.stat().st_mtime_ns == before  # not run again
    commands = [
        line for line in (out / "logs" / f"{lora_run.name}.log").read_text().splitlines() if line.startswith("$ ")
    ]
    assert len(commands) == 2 and "--resume" not in commands[0] and "--resume" in commands[1]
    assert (lora_run / "eval.json").is_file() and (lora_run / "checkpoints" / "step-0000004").is_dir()


def test_parameter_counts_and_times_read_as_people_write_them():
    assert compare.params_text({"trained_params": 99, "total_params": 1_030_000}) == "99 (0.00961%)"
    assert compare.params_text({"trained_params": 4_190, "total_params": 1_030_000}) == "4.19K (0.407%)"
    assert compare.params_text({"trained_params": 1_030_000, "total_params": 1_030_000}) == "1.03M (100%)"
    assert (compare.seconds(42.4), compare.seconds(709)) == ("42 s", "11.8 min")


def test_a_text_head_cell_reports_examples_per_second_not_tokens(tmp_path):
    """T5 and GPT text heads log tok_per_s; the table's ex/s counts examples for every cell alike."""
    run = tmp_path / "cells" / "mnli-t5-lora"
    run.mkdir(parents=True)
    (run / "eval.json").write_text(json.dumps({"dev_matched": {"acc": 0.5, "majority": 0.37}}))
    (run / "config.yaml").write_text(
        yaml.safe_dump({"model": {"family": "t5"}, "train": {"batch_size": 32, "grad_accum": 1}})
    )
    (run / "metrics.jsonl").write_text(
        "".join(
            json.dumps(m) + "\n"
            for m in [
                {"step": 10, "split": "train", "tok_per_s": 3000.0, "elapsed_s": 8.0},
                {"step": 20, "split": "train", "tok_per_s": 3100.0, "elapsed_s": 16.0},
            ]
        )
    )
    row = compare.collect(compare.Cell("mnli", "runs/t5", "lora", "mnli-t5-lora"), tmp_path)
    assert row["ex_per_s"] == 40.0  # 20 steps x 32 examples in 16 s


def test_the_terminal_table_never_cuts_a_cell_name(monkeypatch, tmp_path):
    import io

    from rich.console import Console

    from tfcli import display
    from tfcli.commands import compare as study_module

    out = io.StringIO()
    monkeypatch.setattr(display, "console", Console(file=out, width=80))
    rows = [
        {
            "cell": f"mnli-gpt-mini-20261124-lora-{i}",
            "status": "done",
            "dev_matched_acc": 0.4123,
            "dev_mismatched_acc": 0.4,
            "majority": 0.37,
            "trained_params": 24_576,
            "total_params": 2_000_000,
            "peak_mem_mb": 812.3,
            "train_s": 28.4,
            "ex_per_s": 71.2,
            "family": "gpt",
            "train": "lora",
            "backbone": f"runs/gpt-mini-{i}",
        }
        for i in range(3)
    ]
    study_module.show(rows)
    assert all(r["cell"] in out.getvalue() for r in rows), out.getvalue()
    assert study_module.chart(rows, tmp_path).stat().st_size > 0


@pytest.mark.slow
def test_a_decoder_grid_prompts_and_trains_a_head_on_adapters(mnli_dir, tmp_path):
    """0-shot prompting (an eval cell: nothing trained) beside LoRA with a mean-pooled classifier,
    from a GGUF file; every cell's CPU time comes from the operating system, the trained cell's peak
    memory from its run, and the prompting cell's, smaller than this test's process, is not known
    (the rusage carries this process's own peak into it: it used to be written as the cell's)."""
    from tfcli.hf import interop as hf

    from .test_gguf import tiny_backbone

    gguf = tmp_path / "tiny.gguf"
    hf.export_gguf(tiny_backbone(), None, gguf, "f32")
    out = tmp_path / "study"
    result = invoke(
        "compare",
        "--task",
        "mnli",
        "--from",
        gguf,
        "--train",
        "0shot,lora+head:mean",
        "--budget",
        "2steps",
        "--data",
        mnli_dir,
        "--out",
        out,
        "--report-limit",
        4,
        "--set",
        "train.batch_size=4",
        "--set",
        "finetune.eval_limit=4",
    )
    assert result.exit_code == 0, result.output
    prompt, lora = list(csv.DictReader(open(out / "results.csv")))
    assert (prompt["cell"], lora["cell"]) == ("mnli-tiny.gguf-0shot", "mnli-tiny.gguf-lora-head-mean")
    assert prompt["trained_params"] == "0" and int(lora["trained_params"]) > 0 and prompt["family"] == "llama"
    assert prompt["scored"] == lora["scored"] == "8"  # the same balanced 4 of each of the 2 splits
    assert all(float(r["cpu_s"]) > 0 for r in (prompt, lora))
    assert float(lora["peak_mem_mb"]) > 100 and prompt["peak_mem_mb"] == ""
    config = yaml.safe_load((out / "cells" / lora["cell"] / "config.yaml").read_text())
    assert (config["classify"]["head"], config["classify"]["pooling"], config["finetune"]["train"]) == (
        "classifier",
        "mean",
        "lora",
    )
    assert "none (prompting)" in (out / "results.md").read_text() and (out / "results.png").stat().st_size > 0


@pytest.mark.parametrize(
    "spec, flags",
    [
        ("lora+head", ["--train", "lora", "--head", "classifier"]),
        ("head:last", ["--train", "head", "--head", "classifier", "--pooling", "last"]),
        ("all", ["--train", "all"]),
    ],
)
def test_approaches_read_as_finetune_flags(spec, flags):
    assert compare.parse_approach(spec).flags() == flags


@pytest.mark.parametrize(
    "spec, message",
    [("lora+head:max", "unknown pooling 'max'"), ("prefix", "unknown approach"), ("shot", "unknown approach")],
)
def test_a_bad_approach_is_one_line(spec, message):
    with pytest.raises(UserError, match=message):
        compare.parse_approach(spec)


def test_a_varied_setting_is_one_more_dimension_of_the_grid_but_not_for_prompting():
    grid = compare.load_grid(None, "dpo", "m1", "lora,all,0shot", "2steps", None, None, [], vary=["dpo.beta=0.1,0.3"])
    cells = grid.cells()
    assert [c.name for c in cells] == [
        "dpo-m1-lora-beta0.1",
        "dpo-m1-lora-beta0.3",
        "dpo-m1-all-beta0.1",
        "dpo-m1-all-beta0.3",
        "dpo-m1-0shot",
    ]
    command = compare.cell_command(cells[1], grid, compare.Path("/tmp/nowhere"))
    assert command[command.index("dpo.beta=0.3") - 1] == "--set"
    with pytest.raises(compare.UserError, match="--vary"):
        compare.load_grid(None, "dpo", "m1", "lora", "2steps", None, None, [], vary=["dpo.beta="])


@pytest.mark.slow
def test_a_grpo_grid_with_the_calculator_trains_every_cell_with_it(tmp_path_factory, tmp_path):
    """compare --task grpo with --set grpo.tools=calculator: each cell's run is a GRPO run with the
    tool (its config names it, its steps log TRL's tool metrics), tabulated beside the others."""
    from .test_gguf import chat_gguf_file
    from .test_hostile import PROMPTS

    model = chat_gguf_file(tmp_path_factory, max_seq_len=1024)  # the tool list takes most of the prompt
    data = write_jsonl(tmp_path / "prompts.jsonl", PROMPTS)
    settings = ["grpo.reward=contains", "grpo.tools=calculator", "grpo.chat_template=qwen2.5-instruct"]
    settings += ["train.batch_size=2", "grpo.max_completion_length=8", "grpo.num_generations=2"]
    settings += ["grpo.eval_prompts=2", "data.val_fraction=0.125", "data.seq_len=1024"]
    out = tmp_path / "study"
    args = ["compare", "--task", "grpo", "--from", model, "--train", "lora,all", "--budget", "1steps"]
    args += ["--data", data, "--out", out, "--report-limit", 2]
    result = invoke(*args, *[part for s in settings for part in ("--set", s)])
    assert result.exit_code == 0, result.output
    rows = list(csv.DictReader(open(out / "results.csv")))
    assert [r["status"] for r in rows] == ["done", "done"] and [r["scored"] for r in rows] == ["2", "2"]
    for row in rows:
        cell = out / "cells" / row["cell"]
        assert yaml.safe_load((cell / "config.yaml").read_text())["grpo"]["tools"] == "calculator"
        logged = [json.loads(line) for line in (cell / "metrics.jsonl").read_text().splitlines()]
        assert any("tools/call_frequency" in m for m in logged), logged


@pytest.mark.slow
def test_grids_of_the_post_training_tasks_tabulate_their_scores(tmp_path_factory, tmp_path):
    """compare --task rm (pairwise accuracy) and --task kto (scored by its loss alone: the chart is left
    out, which stopped the command with an internal error before)."""
    from .test_dpo import PAIRS
    from .test_gguf import chat_gguf_file

    model = chat_gguf_file(tmp_path_factory)
    pairs = write_jsonl(tmp_path / "pairs.jsonl", PAIRS * 3)
    rows = [{"prompt": p["prompt"], "completion": p["chosen" if i % 2 else "rejected"], "label": bool(i % 2)}
            for i, p in enumerate(PAIRS * 3)]  # fmt: skip
    labelled = write_jsonl(tmp_path / "rows.jsonl", rows)
    for task, data, column in (("rm", pairs, "dev_acc"), ("kto", labelled, "dev_loss")):
        out = tmp_path / task
        args = ["compare", "--task", task, "--from", model, "--train", "lora", "--budget", "2steps", "--data", data]
        result = invoke(*args, "--out", out, "--set", "train.batch_size=4", "--set", "data.val_fraction=0.25")
        assert result.exit_code == 0 and "internal error" not in result.output, result.output
        (row,) = list(csv.DictReader(open(out / "results.csv")))
        assert row["status"] == "done" and row[column] != "", row


def test_a_cells_peak_is_recorded_only_where_it_is_the_cells_own(tmp_path):
    """A prompting cell's peak comes from the rusage of its process, which carries the compare process's
    own peak through fork and exec: below that, the cell's own peak cannot be told, and none is written
    (it was the compare process's peak before); above it, it is the cell's."""
    import sys

    from .test_memory import held

    ballast = held(400)
    with open(tmp_path / "cell.log", "w") as log:
        rc, usage = compare.run_cell([sys.executable, "-c", "pass"], log)
    assert rc == 0 and usage.inherited_kb > 400 * 1024 and usage.peak_mb is None, usage
    compare.record_usage(tmp_path, usage, 1.0)
    recorded = json.loads((tmp_path / "usage.json").read_text())
    assert recorded["cpu_s"] >= 0 and "peak_rss_mb" not in recorded, recorded
    larger = compare.CellUsage(cpu_s=1.0, maxrss_kb=usage.inherited_kb + 300 * 1024, inherited_kb=usage.inherited_kb)
    compare.record_usage(tmp_path, larger, 1.0)  # a second attempt of the same cell, which peaked higher
    recorded = json.loads((tmp_path / "usage.json").read_text())
    assert recorded["peak_rss_mb"] == round(larger.maxrss_kb / 1024, 1) and recorded["wall_s"] == 2.0, recorded
    del ballast
