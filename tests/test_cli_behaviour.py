"""The command line as a new user meets it: resume overrides, dev-only evaluation data, `--train head`
on decoders, the newest run that can generate, few-shot that does not fit, warmup longer than the
run, capped lists in errors."""

from __future__ import annotations

import json

import pytest
import yaml

from .conftest import invoke, read_metrics, tiny_gpt_recipe


def gpt_run(tmp_path, small_text, name="run", **train):
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(
        yaml.safe_dump(tiny_gpt_recipe(small_text, train={"steps": 4, "eval_interval": 4, "ckpt_interval": 2, **train}))
    )
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
        f"run for optim.lr=0.5"
    ]
    assert (run / "config.yaml").read_text() == before
    longer = invoke("pretrain", "--resume", run, "--steps", 6, "--quiet")  # training longer is what resume is for
    assert longer.exit_code == 0, longer.output
    assert max(m["step"] for m in read_metrics(run)) == 6


def test_each_method_reads_its_own_defaults_and_the_command_line_wins(tmp_path):
    from tfcli import recipe as recipes

    lora = recipes.load("mnli-minilm", {"finetune.train": "lora"})
    assert lora.optim.lr == 1e-3 and lora.settings.pooling == "mean"
    assert set(lora.adapter.parts) >= {"q", "k", "v", "o", "up", "down"}
    assert recipes.load("mnli-minilm", {"finetune.train": "lora", "optim.lr": 5e-4}).optim.lr == 5e-4
    assert recipes.load("mnli-minilm", {"finetune.train": "bitfit"}).optim.lr == 1e-2
    full = recipes.load("mnli-minilm")
    assert full.optim.lr == 1e-4 and full.settings.pooling == "cls" and full.adapter.targets == ("q", "v")
    assert recipes.load("mnli-gpt-mini", {"finetune.train": "lora"}).settings.pooling == "auto"  # a GPT's own
    recipes.save(lora, tmp_path / "config.yaml")  # a run's recipe: applied, without the table
    assert "methods" not in (tmp_path / "config.yaml").read_text()
    assert recipes.load(str(tmp_path / "config.yaml"), {"finetune.train": "lora"}).optim.lr == 1e-3


def test_train_head_on_a_decoder_trains_a_classifier_on_its_frozen_features(tmp_path, small_text, mnli_dir):
    from .conftest import pretrained_run

    run = pretrained_run(
        tmp_path,
        small_text,
        "clm",
        {"family": "gpt", "n_layer": 1, "n_head": 2, "d_model": 32, "d_ff": 64, "max_seq_len": 64},
    )
    result = invoke(
        "finetune",
        "mnli",
        "--from",
        run,
        "--data",
        mnli_dir,
        "--train",
        "head",
        "--steps",
        2,
        "--out",
        tmp_path / "probe",
    )
    assert result.exit_code == 0, result.output
    assert "--train head on a gpt: a classifier on its frozen last-layer features" in " ".join(result.output.split())
    saved = yaml.safe_load((tmp_path / "probe" / "config.yaml").read_text())
    assert saved["classify"]["head"] == "classifier" and saved["finetune"]["train"] == "head"
    parameters = json.loads((tmp_path / "probe" / "run.json").read_text())["parameters"]
    assert parameters["trained"] == 3 * 32 + 3  # the classifier alone


def test_eval_reads_a_directory_of_evaluation_files_alone(hf_bert, mnli_dir, tmp_path):
    import shutil

    run = tmp_path / "ft"
    assert (
        invoke(
            "finetune", "mnli", "--from", hf_bert, "--data", mnli_dir, "--steps", 1, "--out", run, "--quiet"
        ).exit_code
        == 0
    )
    dev = tmp_path / "dev-only"
    dev.mkdir()
    for split in ("dev_matched", "dev_mismatched"):
        shutil.copy(mnli_dir / f"{split}.jsonl", dev)
    result = invoke("eval", "mnli", "--checkpoint", run, "--data", dev)
    assert result.exit_code == 0, result.output
    report = json.loads((run / "eval-mnli-dev-only.json").read_text())
    assert report["dev_matched"]["n"] == 30 and report["dev_mismatched"]["n"] == 30
    assert "train" not in result.output


def test_a_warmup_longer_than_the_run_is_clipped_with_a_note(tmp_path, small_text):
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(
        yaml.safe_dump(
            tiny_gpt_recipe(
                small_text, schedule={"warmup_steps": 40}, optim={"lr": 1e-3}, train={"steps": 20, "eval_interval": 20}
            )
        )
    )
    result = invoke("pretrain", "--recipe", recipe, "--out", tmp_path / "run")
    assert result.exit_code == 0, result.output
    assert "schedule.warmup_steps 40 is longer than the run's 20 steps: warming up for 2" in " ".join(
        result.output.split()
    )
    lrs = [m["lr"] for m in read_metrics(tmp_path / "run") if m.get("split") == "train"]
    assert max(lrs) > 0.9e-3 and lrs[-1] < lrs[2]  # it reaches its peak, then decays
    assert yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["schedule"]["warmup_steps"] == 2


def test_generate_without_a_checkpoint_takes_the_newest_run_that_can_generate(tmp_path, small_text, monkeypatch):
    import time

    from .conftest import tiny_bert_recipe

    monkeypatch.chdir(tmp_path)
    gpt_run(tmp_path, small_text, "runs/gpt")
    time.sleep(0.05)
    (tmp_path / "bert.yaml").write_text(
        yaml.safe_dump(tiny_bert_recipe(small_text, train={"steps": 2, "ckpt_interval": 2}))
    )
    assert invoke("pretrain", "--recipe", tmp_path / "bert.yaml", "--out", "runs/bert", "--quiet").exit_code == 0
    result = invoke("generate", "--prompt", "ROMEO:", "--max-new-tokens", 3, "--greedy")
    assert result.exit_code == 0, result.output
    assert "note: using the newest run that can generate: runs/gpt" in result.output


def test_few_shot_scoring_where_no_example_fits_is_an_error_not_zero_shot(tmp_path, small_text, mnli_dir):
    from .conftest import pretrained_run

    run = pretrained_run(
        tmp_path,
        small_text,
        "clm",
        {"family": "gpt", "n_layer": 1, "n_head": 2, "d_model": 32, "d_ff": 64, "max_seq_len": 48},
    )
    result = invoke("eval", "mnli", "--checkpoint", run, "--data", mnli_dir, "--few-shot", 4, "--limit", 3)
    assert result.exit_code == 2
    (line,) = result.output.strip().splitlines()[-1:]
    assert line.startswith("error: --few-shot 4: no solved example fits beside the questions in this model's"), line
    zero = invoke("eval", "mnli", "--checkpoint", run, "--data", mnli_dir, "--few-shot", 0, "--limit", 3)
    assert zero.exit_code == 0, zero.output


def test_flops_count_what_runs_and_mfu_is_never_a_pinned_cap():
    """A T5 classifier on encoder features runs the encoder alone; adapters do no weight gradients
    (4 FLOPs per parameter and token, not 6); an MFU above 1 is shown as n/a, not as 100%."""
    from tfcli.display import _fmt
    from tfcli.engine.perf import mfu
    from tfcli.models.t5 import T5, T5Config
    from tfcli.tasks.heads import ClassifierHead

    model = T5(T5Config(n_layer=2, n_decoder_layer=2, n_head=2, d_model=32, d_ff=64, vocab_size=100))
    encoder = sum(p.numel() for p in model.encoder.parameters())
    head = ClassifierHead(model.cfg, "encoder-mean", 3, lambda d, t: None, tokens_per_item=10.0)
    attention = 12.0 * 2 * 10 * 32 * 10
    assert head.flops_per_item(model, [], "all") == 6 * encoder * 10 + attention
    assert head.flops_per_item(model, [], "lora") == 4 * encoder * 10 + attention * 4 / 6
    assert head.flops_per_item(model, [], "head") == 2 * encoder * 10 + attention * 2 / 6
    assert mfu(5.0, 10.0) == 0.5 and mfu(11.0, 10.0) is None
    assert _fmt("mfu", None) == "n/a" and _fmt("mfu", 0.25) == "25.0%"


def test_a_phase_with_a_known_total_shows_the_share_done(monkeypatch):
    import io

    from rich.console import Console

    from tfcli import display

    out = io.StringIO()
    monkeypatch.setattr(display, "console", Console(file=out, force_terminal=True, width=120))
    monkeypatch.setattr(display, "_state", {"live": True, "progress": None})
    with display.phase("scoring dev", 4, "batches") as advance:
        for _ in display.counted(range(4), advance):
            pass
    with display.phase("tokenizing a.txt", 2_500_000, "bytes") as advance:
        advance(1_250_000)
    text = out.getvalue()
    assert "of 4 batches" in text and "of 2.5 MB" in text and "%" in text


def test_errors_about_users_data_stay_one_short_line(tmp_path, shared_data, hf_bert):
    """GSM8K's worked answers named as the label column: refused as not a label column, in one line
    that shows a few values, not 7,473 multi-line ones; an unknown label lists a capped label set."""
    rows = (shared_data / "sft" / "gsm8k" / "train.jsonl").read_text().splitlines()[:400]
    (tmp_path / "gsm8k.jsonl").write_text("\n".join(rows) + "\n")
    result = invoke(
        "finetune",
        "classify",
        "--from",
        hf_bert,
        "--data",
        tmp_path / "gsm8k.jsonl",
        "--text-fields",
        "question",
        "--label-field",
        "answer",
        "--steps",
        1,
        "--out",
        tmp_path / "run",
    )
    assert result.exit_code == 2
    (line,) = [l for l in result.output.splitlines() if l.startswith("error:")]
    assert "column 'answer' has 360 distinct values in 360 rows" in line and "and 357 more): not a label column" in line
    assert len(line) < 600 and not (tmp_path / "run").exists()
    (tmp_path / "many").mkdir()
    labels = [f"topic{i}" for i in range(60)]
    (tmp_path / "many" / "train.jsonl").write_text(
        "".join(json.dumps({"text": f"t {i}", "label": labels[i % 60]}) + "\n" for i in range(600))
    )
    (tmp_path / "many" / "dev.jsonl").write_text(json.dumps({"text": "x", "label": "nope"}) + "\n")
    result = invoke(
        "finetune",
        "classify",
        "--from",
        hf_bert,
        "--data",
        tmp_path / "many",
        "--text-fields",
        "text",
        "--label-field",
        "label",
        "--steps",
        1,
        "--out",
        tmp_path / "run2",
    )
    assert result.exit_code == 2
    (line,) = [l for l in result.output.splitlines() if l.startswith("error:")]
    assert "unknown label 'nope'" in line and "and 52 more" in line, line


def test_threads_are_this_process_share_of_the_cores_nobody_else_uses(monkeypatch, tmp_path, small_text):
    from tfcli.engine import runtime

    monkeypatch.setattr(runtime, "usable_cores", lambda: 4)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert runtime.choose_threads(3) == (3, "train.threads")
    assert runtime.choose_threads(0) == (4, "4 usable cores")
    monkeypatch.setattr(runtime, "busy_cores", lambda seconds=0.2: 2.6)  # another job on about 3 cores
    assert runtime.choose_threads(0) == (1, "4 usable cores, 2.6 busy with other work")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # torchrun: the node's processes split the cores
    assert runtime.choose_threads(0) == (2, "4 usable cores shared by 2 processes")
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.setattr(runtime, "usable_cores", lambda: 1)  # one core: nothing to choose, nothing sampled
    monkeypatch.setattr(runtime, "busy_cores", lambda seconds=0.2: pytest.fail("sampled /proc/stat for one core"))
    assert runtime.choose_threads(0) == (1, "1 usable core")
    monkeypatch.setattr(runtime, "usable_cores", lambda: 4)
    monkeypatch.setattr(runtime, "busy_cores", lambda seconds=0.2: 2.6)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    from .conftest import measured_busy_cores

    assert 0.0 <= measured_busy_cores(0.05) <= (__import__("os").cpu_count() or 1)
    # the run's header says what it chose, and a resumed run keeps it
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.setattr(runtime, "usable_cores", lambda: 2)
    monkeypatch.setattr(runtime, "busy_cores", lambda seconds=0.2: 1.0)
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(yaml.safe_dump(tiny_gpt_recipe(small_text, train={"steps": 2, "ckpt_interval": 2})))
    first = invoke("pretrain", "--recipe", recipe, "--out", tmp_path / "run")
    assert "1 CPU thread (2 usable cores, 1.0 busy with other work)" in " ".join(first.output.split())
    monkeypatch.setattr(runtime, "busy_cores", lambda seconds=0.2: 0.0)
    again = invoke("pretrain", "--resume", tmp_path / "run", "--steps", 3)
    assert "1 CPU thread (as the run trained with)" in " ".join(again.output.split()), again.output


def test_tfcli_starts_without_importing_torchs_compiler_or_its_distributed_checkpoint():
    """Every tfcli process imported torch's compiler (dynamo, ~1.3 s) and torch.distributed.checkpoint at
    start, and most never use them (train.compile auto is off on CPU; one process saves whole
    checkpoints): they are imported where a run compiles, or saves, instead."""
    import subprocess
    import sys

    modules = ["tfcli.cli", "tfcli.driver", "tfcli.engine.trainer", "tfcli.generate", "tfcli.commands.training"]
    modules += ["tfcli.commands.trained", "tfcli.commands.compare", "tfcli.commands.probe", "tfcli.tasks"]
    heavy = ["torch._dynamo", "torch.distributed.checkpoint", "torch.distributed.tensor"]
    code = f"import sys, importlib\nfor m in {modules!r}: importlib.import_module(m)\nprint([m for m in {heavy!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


@pytest.mark.slow  # 6-13 s: the fast tier keeps under 3 minutes
def test_set_train_steps_wins_over_the_recipes_epochs_as_the_steps_flag_does(tmp_path):
    """`--steps 2` trained 2 steps, `--set train.steps=2` silently trained finetune.epochs' worth."""
    from .conftest import hf_llama_dir, write_jsonl

    model = hf_llama_dir(tmp_path / "m")
    rows = write_jsonl(tmp_path / "rows.jsonl", [{"prompt": "a b", "completion": " c d"}] * 64)
    for flags in (["--steps", "2"], ["--set", "train.steps=2"]):
        result = invoke("finetune", "sft", "--from", model, "--data", rows, "--dry-run", *flags)
        assert result.exit_code == 0, result.output
        assert "2 steps" in result.output, (flags, result.output)
    both = invoke(
        "finetune", "sft", "--from", model, "--data", rows, "--dry-run", "--set", "train.steps=2",
        "--set", "finetune.epochs=2",
    )  # fmt: skip
    assert both.exit_code == 0 and "16 steps" in both.output, both.output  # epochs named too: they decide
