"""Hostile and broken inputs (tests/hostile/): a run directory that names a reward file, damaged
shards, broken benchmark files, runs that cannot evaluate, bad settings. Each is one line and exit code
2 before any compute is spent, leaves nothing behind, and runs no code the command line did not name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from .conftest import invoke, write_jsonl

HOSTILE = Path(__file__).parent / "hostile"
EVIL = HOSTILE / "evil_reward.py"
PROMPTS = [{"prompt": f"What is {a} plus {b}?", "answer": str(a + b)} for a in range(1, 9) for b in range(1, 5)]


def refused(result, *words: str) -> str:
    """The one-line refusal: exit 2, no traceback, every word in it."""
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and "internal error" not in result.output, result.output
    for word in words:
        assert word in result.output, result.output
    return result.output


def tree(path: Path) -> dict[str, int]:
    """Every file under `path` with its size: what a refused command must leave as it was."""
    return {str(p.relative_to(path)): p.stat().st_size for p in sorted(path.rglob("*")) if p.is_file()}


# --- a run directory is data: the reward file it names is not imported --------------------------


@pytest.fixture(scope="module")
def grpo_run(tmp_path_factory):
    """A tiny GRPO run (a built-in reward), whose config.yaml is then made to name tests/hostile's
    evil_reward.py, as a run handed over by someone else may."""
    root = tmp_path_factory.mktemp("grpo")
    model = root / "model"
    pretrain = ["pretrain", "--objective", "clm", "--recipe", "gpt-shakespeare-char", "--steps", 1, "--out", model]
    assert invoke(*pretrain, "--quiet", "--set", "model.n_layer=1", "--set", "model.d_model=32").exit_code == 0
    data = write_jsonl(root / "prompts.jsonl", PROMPTS)
    args = ["finetune", "grpo", "--from", model, "--data", data, "--reward", "contains", "--steps", 1]
    args += ["--batch-size", 2, "--out", root / "run", "--quiet", "--set", "grpo.max_completion_length=4"]
    args += ["--set", "grpo.num_generations=2", "--set", "grpo.eval_prompts=2", "--set", "data.val_fraction=0.125"]
    result = invoke(*args)
    assert result.exit_code == 0, result.output
    config = root / "run" / "config.yaml"
    raw = yaml.safe_load(config.read_text())
    raw["grpo"]["reward"] = f"{EVIL}:fn"
    config.write_text(yaml.safe_dump(raw, sort_keys=False))
    return root / "run"


@pytest.fixture
def mark(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("TFCLI_HOSTILE_MARK", str(tmp_path / "mark"))
    return tmp_path / "mark"


@pytest.mark.parametrize(
    "command",
    [
        ["eval", "--limit", 1],
        ["eval", "grpo", "--limit", 1],
        ["finetune", "--steps", 2],
    ],
    ids=["eval", "eval-grpo", "resume"],
)
def test_a_reward_file_a_run_names_is_not_imported(grpo_run, mark, tmp_path, command):
    run = tmp_path / "run"
    shutil.copytree(grpo_run, run)
    before = tree(run)
    where = ["--resume", run] if command[0] == "finetune" else ["--checkpoint", run]
    refused(invoke(*command, *where), f"--reward {EVIL}:fn")
    assert not mark.exists(), "the run's reward file was imported"
    assert tree(run) == before


def test_the_reward_file_runs_when_the_command_line_names_it(grpo_run, mark, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # named relative to the working directory: the same file as the run's record
    shutil.copy(EVIL, tmp_path / "evil_reward.py")
    result = invoke(
        "eval", "grpo", "--checkpoint", grpo_run, "--limit", 1, "--reward", "evil_reward.py:fn", "--out", "e.json"
    )
    assert result.exit_code == 0, result.output
    assert mark.read_text() == "imported"


EVIL_TOOLS = HOSTILE / "evil_tools.py"


@pytest.fixture(scope="module")
def tools_run(tmp_path_factory):
    """A tiny GRPO run with the calculator, whose config.yaml is then made to name tests/hostile's
    evil_tools.py as its tools and its environment."""
    from .test_gguf import chat_gguf_file

    root = tmp_path_factory.mktemp("tools")
    model = chat_gguf_file(tmp_path_factory, max_seq_len=1024)  # three tools listed: 600 tokens of prompt
    data = write_jsonl(root / "prompts.jsonl", PROMPTS)
    args = ["finetune", "grpo", "--from", model, "--data", data, "--reward", "contains", "--tools", "calculator"]
    args += ["--chat-template", "qwen2.5-instruct", "--steps", 1, "--batch-size", 2, "--out", root / "run"]
    args += ["--quiet", "--set", "grpo.max_completion_length=8", "--set", "grpo.num_generations=2"]
    args += ["--set", "grpo.eval_prompts=2", "--set", "data.val_fraction=0.125", "--set", "data.seq_len=1024"]
    result = invoke(*args)
    assert result.exit_code == 0, result.output
    config = root / "run" / "config.yaml"
    raw = yaml.safe_load(config.read_text())
    raw["grpo"]["tools"] = f"calculator,{EVIL_TOOLS}:fn"
    raw["grpo"]["env"] = f"{EVIL_TOOLS}:Env"
    config.write_text(yaml.safe_dump(raw, sort_keys=False))
    return root / "run"


@pytest.mark.parametrize(
    "command",
    [["eval", "--limit", 1], ["eval", "grpo", "--limit", 1], ["finetune", "--steps", 2]],
    ids=["eval", "eval-grpo", "resume"],
)
def test_a_tools_file_a_run_names_is_not_imported(tools_run, mark, tmp_path, command):
    run = tmp_path / "run"
    shutil.copytree(tools_run, run)
    before = tree(run)
    where = ["--resume", run] if command[0] == "finetune" else ["--checkpoint", run]
    refused(invoke(*command, *where), f"{EVIL_TOOLS}:fn", "--tools")
    assert not mark.exists(), "the run's tools file was imported"
    assert tree(run) == before


def test_generate_and_export_of_a_run_with_a_tools_file_import_nothing(tools_run, mark, tmp_path):
    made = invoke("generate", "--checkpoint", tools_run, "--prompt", "hi", "--max-new-tokens", 2, "--greedy")
    assert made.exit_code == 0, made.output
    exported = invoke("export", "--checkpoint", tools_run, "--hf", tmp_path / "hf")
    assert exported.exit_code == 0, exported.output
    assert not mark.exists(), "generate or export imported the run's tools file"


def test_the_tools_file_runs_when_the_command_line_names_it(tools_run, mark, tmp_path):
    spec = f"calculator,{EVIL_TOOLS}:fn"
    result = invoke("eval", "grpo", "--checkpoint", tools_run, "--limit", 1, "--tools", spec,
                    "--env", f"{EVIL_TOOLS}:Env", "--out", tmp_path / "e.json")  # fmt: skip
    assert result.exit_code == 0, result.output
    assert mark.read_text() == "imported"


def test_a_grid_file_that_names_a_reward_file_is_refused(grpo_run, mark, tmp_path):
    grid = tmp_path / "grid.yaml"
    grid.write_text(yaml.safe_dump({"tasks": "grpo", "from": str(grpo_run), "set": {"grpo.reward": f"{EVIL}:fn"}}))
    result = invoke("compare", "--grid", grid, "--out", tmp_path / "study")
    refused(result, f"--set grpo.reward={EVIL}:fn")
    assert not mark.exists() and not (tmp_path / "study").exists()


# --- --resume auto -----------------------------------------------------------------------------


def test_resume_auto_continues_the_newest_unfinished_run(tmp_path, monkeypatch, small_text):
    from .conftest import tiny_gpt_recipe

    monkeypatch.chdir(tmp_path)
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(yaml.safe_dump(tiny_gpt_recipe(small_text, train={"steps": 4, "ckpt_interval": 2})))
    assert invoke("pretrain", "--recipe", recipe, "--quiet").exit_code == 0
    (run,) = (tmp_path / "runs").iterdir()
    shutil.rmtree(run / "checkpoints" / "step-0000004")
    (run / "checkpoints" / "latest").write_text("step-0000002")
    result = invoke("pretrain", "--recipe", recipe, "--resume", "auto", "--quiet")
    assert result.exit_code == 0, result.output
    assert f"resuming the newest unfinished run of this recipe: runs/{run.name}" in result.output
    assert (run / "checkpoints" / "step-0000004").is_dir()


# --- what a user sees -------------------------------------------------------------------------------


def test_a_run_records_absolute_paths_and_is_evaluated_from_anywhere(tmp_path, monkeypatch, small_text):
    from .conftest import tiny_gpt_recipe

    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    (work / "data").mkdir(parents=True)
    elsewhere.mkdir()
    shutil.copy(small_text, work / "data" / "text.txt")
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(yaml.safe_dump(tiny_gpt_recipe(Path("unused"), train={"steps": 2, "ckpt_interval": 2})))
    monkeypatch.chdir(work)
    result = invoke("pretrain", "--recipe", recipe, "--data", "data/text.txt", "--out", "run", "--quiet")
    assert result.exit_code == 0, result.output
    saved = yaml.safe_load((work / "run" / "config.yaml").read_text())
    assert saved["data"]["source"] == str(work / "data" / "text.txt")
    monkeypatch.chdir(elsewhere)
    result = invoke("eval", "--checkpoint", work / "run", "--out", "e.json")
    assert result.exit_code == 0, result.output


# --- a run that cannot evaluate decides so before step 1 ---------------------------------------------


@pytest.fixture(scope="module")
def char_model(tmp_path_factory):
    out = tmp_path_factory.mktemp("char") / "model"
    args = ["pretrain", "--objective", "clm", "--recipe", "gpt-shakespeare-char", "--steps", 1, "--out", out]
    assert invoke(*args, "--quiet", "--set", "model.n_layer=1", "--set", "model.d_model=32").exit_code == 0
    return out


QA = [
    {"prompt": f"What is {a} plus {b}?", "completion": f"It is {a + b}.", "answer": str(a + b)}
    for a in range(6)
    for b in range(4)
]
TOO_LONG = [{"prompt": "x" * 400, "completion": "y" * 300, "chosen": "y" * 300, "rejected": "z", "answer": "1"}] * 4


@pytest.mark.parametrize(
    "task",
    [
        ["sft"],
        ["dpo"],
        ["grpo", "--reward", "contains", "--set", "grpo.max_completion_length=8", "--set", "grpo.num_generations=2"],
    ],
    ids=["sft", "dpo", "grpo"],
)
def test_a_run_whose_held_out_rows_are_all_skipped_says_so_before_training(tmp_path, char_model, task):
    rows = [{**r, "chosen": r["completion"], "rejected": "No."} for r in QA]
    data, dev = write_jsonl(tmp_path / "qa.jsonl", rows), write_jsonl(tmp_path / "dev.jsonl", TOO_LONG)
    args = ["finetune", *task, "--from", char_model, "--data", data, "--set", f"data.val_source={dev}"]
    result = invoke(*args, "--train", "lora", "--steps", 2, "--out", tmp_path / "run")
    assert result.exit_code == 0, result.output
    note = f"{task[0]}: no held-out examples"
    assert note in result.output and result.output.index(note) < result.output.index("step"), result.output
    assert "evaluate it" not in result.output  # a hint that would not run
    assert (tmp_path / "run" / "checkpoints" / "latest").is_file() and not (tmp_path / "run" / "eval.json").exists()


# --- broken benchmark files: one line naming the file and the row, before any model is read ----------

BENCH = HOSTILE / "bench"
BROKEN_BENCHMARKS = [
    ("files_string.yaml", None, "files_string.yaml: files must be a mapping of names to file names"),
    ("rows_lists.yaml", None, "lists.jsonl line 1: a row is a JSON object of fields, got list"),
    ("choices_string.yaml", None, "choices must be a list of templates, one per choice"),
    ("missing_field.yaml", None, "rows.jsonl line 1: 'question' is undefined"),
    ("unknown_format.yaml", None, "format 'tsv' is not one tfcli reads"),
    ("empty_split.yaml", None, "empty.jsonl has no rows"),
    ("piqa", "piqa_no_sol2", "piqa_no_sol2/valid.jsonl line 2: 'sol2' is undefined"),
    ("piqa", "piqa_no_labels", "piqa_no_labels/valid-labels.lst is missing"),
    ("piqa", "piqa_bad_utf8", "piqa_bad_utf8/valid.jsonl line 2: not UTF-8 text"),
    ("piqa", "piqa_bad_json", "piqa_bad_json/valid.jsonl line 2: not JSON"),
]


@pytest.fixture
def no_model_is_read(monkeypatch):
    """Reading a model fails loudly: the refusals below must come first."""
    from tfcli.engine import backbone

    def read(*args, **kwargs):
        raise AssertionError("a model was read before the benchmark's files were checked")

    for name in ("for_inference", "load", "from_run", "from_hf"):
        monkeypatch.setattr(backbone, name, read)


@pytest.mark.parametrize("bench,data,message", BROKEN_BENCHMARKS, ids=[b[2].split(":")[0] for b in BROKEN_BENCHMARKS])
def test_a_broken_benchmark_is_one_line_before_any_model_is_read(
    bench, data, message, tmp_path, monkeypatch, no_model_is_read
):
    monkeypatch.chdir(tmp_path)
    name = str(BENCH / bench) if bench.endswith(".yaml") else bench
    where = ["--data", BENCH / data] if data else []
    refused(invoke("eval", name, "--checkpoint", tmp_path / "model.gguf", *where), message)
    assert list(tmp_path.iterdir()) == []  # nothing written


@pytest.mark.parametrize(
    "bench,data,message", BROKEN_BENCHMARKS[:3] + BROKEN_BENCHMARKS[6:7], ids=["files", "lists", "choices", "piqa"]
)
def test_a_broken_benchmark_inside_training_stops_before_step_1(
    bench, data, message, tmp_path, char_model, no_model_is_read
):
    name = str(BENCH / bench) if bench.endswith(".yaml") else bench
    data_dir = BENCH / data if data else BENCH
    args = ["finetune", "sft", "--from", char_model, "--data", write_jsonl(tmp_path / "qa.jsonl", QA), "--steps", 2]
    args += [
        "--set",
        f"train.eval_tasks=[{name}]",
        "--set",
        f"train.eval_tasks_data={data_dir}",
        "--out",
        tmp_path / "run",
    ]
    refused(invoke(*args), message)
    assert not (tmp_path / "run").exists()


def test_the_well_formed_control_scores(tmp_path, char_model):
    out = tmp_path / "good.json"
    result = invoke("eval", BENCH / "good.yaml", "--checkpoint", char_model, "--out", out)
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["n-samples"]["good"] == {"original": 2, "effective": 2}


def test_a_list_is_checked_whole_before_any_part_is_scored_and_out_decides_where_all_goes(
    tmp_path, char_model, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    data = tmp_path / "data"
    (data / "gsm8k").mkdir(parents=True)
    rows = [{"question": f"What is {i} plus {i}?", "answer": f"#### {2 * i}"} for i in range(2)]
    write_jsonl(data / "gsm8k" / "test.jsonl", rows)
    write_jsonl(data / "long.jsonl", [{"q": "why? " * 200, "a": "yes", "b": "no", "label": 0}])
    (data / "long.yaml").write_text(
        yaml.safe_dump(
            {
                "data": ".",
                "files": {"test": "long.jsonl"},
                "context": "{{q}}",
                "choices": ["{{a}}", "{{b}}"],
                "answer": "{{label}}",
            }
        )
    )
    refused(
        invoke("eval", f"gsm8k,{data / 'long.yaml'}", "--checkpoint", char_model, "--data", data),
        "does not fit the model's",
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]  # gsm8k's report was not written first
    good = BENCH / "good.yaml"
    shutil.copy(BENCH / "rows.jsonl", data / "rows.jsonl")
    args = [
        "eval",
        f"gsm8k,{good}",
        "--checkpoint",
        char_model,
        "--data",
        data,
        "--out",
        tmp_path / "results" / "all.json",
    ]
    result = invoke(*args, "--set", "sft.max_new_tokens=2")
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "results"]
    assert {p.name for p in (tmp_path / "results").iterdir()} == {
        "all.json",
        "all-gsm8k.json",
        "all-gsm8k-predictions.jsonl",
    }


# --- bad settings and rewards --------------------------------------------------------------------------


def test_qlora_on_a_fresh_model_is_refused_before_step_1(tmp_path):
    data = write_jsonl(tmp_path / "qa.jsonl", QA)
    result = invoke("finetune", "sft", "--data", data, "--train", "qlora", "--steps", 2, "--out", tmp_path / "run")
    refused(result, "--train qlora freezes a pretrained model", "give --from MODEL")
    assert not (tmp_path / "run").exists()


def test_a_negative_micro_batch_is_refused(tmp_path, small_text):
    from .conftest import tiny_gpt_recipe

    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(tiny_gpt_recipe(small_text)))
    result = invoke("pretrain", "--recipe", recipe, "--set", "train.micro_batch_size=-1", "--out", tmp_path / "run")
    refused(result, "train.micro_batch_size must be 0 or a divisor of train.batch_size (8), got -1")


def grpo_args(tmp_path, model, reward: str, rows=QA, *more):
    data = write_jsonl(tmp_path / "qa.jsonl", rows)
    return [
        "finetune", "grpo", "--from", model, "--data", data, "--reward", reward, "--steps", 1, "--batch-size", 2,
        "--out", tmp_path / "run", "--set", "grpo.max_completion_length=4", "--set", "grpo.num_generations=2",
        "--set", "grpo.eval_prompts=2", *more,
    ]  # fmt: skip


def test_an_infinite_reward_is_one_line(tmp_path, char_model):
    (tmp_path / "r.py").write_text("def inf(completions, **kw):\n    return [float('inf') for _ in completions]\n")
    refused(invoke(*grpo_args(tmp_path, char_model, f"{tmp_path}/r.py:inf")), "returned inf for training row 1")
    assert not (tmp_path / "run").exists()


def test_nan_rewards_are_taken_as_none_and_said_once_as_a_count(tmp_path, char_model):
    (tmp_path / "r.py").write_text(
        "import math\ndef half(completions, **kw):\n    return [math.nan if i % 2 else 1.0 for i, _ in enumerate(completions)]\n"
    )
    result = invoke(*grpo_args(tmp_path, char_model, f"{tmp_path}/r.py:half"))
    assert result.exit_code == 0, result.output
    assert result.output.count("returned NaN for") == 1, result.output
    assert "reward half returned NaN for 2 of 4 training completions; NaN is taken as None" in result.output


def test_rows_no_reward_can_score_are_skipped_with_a_count(tmp_path, char_model):
    rows = [{**r, "answer": "no number here" if i % 4 == 0 else r["answer"]} for i, r in enumerate(QA)]
    result = invoke(*grpo_args(tmp_path, char_model, "final-number", rows))
    assert result.exit_code == 0, result.output
    assert "rows skipped: no reward can score them (their 'answer' has no final number or is empty)" in result.output
    none = [{**r, "answer": "none"} for r in QA]
    (tmp_path / "x").mkdir()
    refused(invoke(*grpo_args(tmp_path / "x", char_model, "final-number", none)), "no reward can score them")


def test_every_command_that_reads_a_run_takes_its_best_checkpoint_and_says_so(tmp_path, char_model):
    run = tmp_path / "run"
    args = ["finetune", "sft", "--from", char_model, "--data", write_jsonl(tmp_path / "qa.jsonl", QA), "--steps", 4]
    args += ["--out", run, "--quiet", "--set", "train.eval_interval=2", "--set", "train.ckpt_interval=2"]
    args += ["--set", "sft.generate_limit=1", "--set", "sft.max_new_tokens=2", "--set", "train.keep_checkpoints=5"]
    assert invoke(*args).exit_code == 0
    (run / "checkpoints" / "best").write_text("step-0000002")  # whichever it was, best and latest now differ
    said = f"reading step-0000002, the best checkpoint of {run} (its latest is step-0000004)"
    commands = [
        ["generate", "--checkpoint", run, "--prompt", "a", "--max-new-tokens", 2],
        ["eval", "--checkpoint", run, "--set", "sft.max_new_tokens=2", "--out", tmp_path / "e.json"],
        ["export", "--checkpoint", run, "--hf", tmp_path / "hf"],
        ["finetune", "sft", "--from", run, "--data", tmp_path / "qa.jsonl", "--steps", 1, "--out", tmp_path / "again"],
    ]
    for command in commands:
        result = invoke(*command, "--set", "sft.generate_limit=1") if command[0] == "finetune" else invoke(*command)
        assert result.exit_code == 0, result.output
        assert said in result.output, (command[0], result.output)
    chat = invoke("chat", "--checkpoint", run, "--chat-template", "chatml", "--max-new-tokens", 2, input="hi\n/exit\n")
    assert chat.exit_code == 0 and said in chat.output, chat.output


def test_a_held_out_metric_has_one_name_in_select_by_runs_and_plot(tmp_path, char_model):
    run = tmp_path / "runs" / "run"
    args = ["finetune", "sft", "--from", char_model, "--data", write_jsonl(tmp_path / "qa.jsonl", QA), "--steps", 2]
    args += ["--out", run, "--quiet", "--set", "train.eval_interval=1", "--set", "sft.generate_limit=1"]
    args += ["--set", f"train.eval_tasks=[{BENCH / 'good.yaml'}]", "--set", f"train.eval_tasks_data={BENCH}"]
    assert invoke(*args, "--set", "train.select_by=val_good_acc_norm").exit_code == 0
    listed = invoke("runs", tmp_path / "runs")
    assert "val_good_acc_norm" in listed.output.replace("│", "").replace("\n", "").replace(" ", ""), listed.output
    drawn = invoke("plot", run, "--metric", "val_good_acc_norm", "--out", tmp_path / "p.png")
    assert drawn.exit_code == 0 and (tmp_path / "p.png").is_file(), drawn.output
    refused(invoke("plot", run, "--metric", "nope"), "val_good_acc_norm")  # the list names them so too


def test_a_piped_evaluation_prints_progress_lines_and_counts_questions(tmp_path, char_model, monkeypatch):
    from tfcli import display

    monkeypatch.setattr(display, "PIPED_EVERY_S", 0.0)  # CliRunner's output is a pipe: a line at every advance
    out = tmp_path / "e.json"
    result = invoke("eval", BENCH / "good.yaml", "--checkpoint", char_model, "--out", out, "--batch-size", 1)
    assert result.exit_code == 0, result.output
    assert (
        "good: scoring: 1 of 2 questions (50%), eta" in result.output
        and "good: scoring: 2 questions in" in result.output
    )
    data = tmp_path / "gsm8k"
    data.mkdir()
    write_jsonl(data / "test.jsonl", [{"question": "What is 1 plus 1?", "answer": "#### 2"}])
    asked = invoke(
        "eval", "gsm8k", "--checkpoint", char_model, "--data", data, "--set", "sft.max_new_tokens=2", "--out", out
    )
    assert asked.exit_code == 0, asked.output
    assert "sft test: 1 questions from" in asked.output and "tokens trained" not in asked.output


def test_chat_says_reset_and_a_data_folder_with_test_and_no_dev_is_taken(tmp_path, char_model):
    chat = invoke(
        "chat", "--checkpoint", char_model, "--chat-template", "chatml", "--max-new-tokens", 1, input="hi\n/reset\n"
    )
    assert chat.exit_code == 0 and "[conversation reset]" in chat.output, chat.output
    folder = tmp_path / "data"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", QA)
    write_jsonl(folder / "test.jsonl", QA[:4])
    for task in (["grpo", "--reward", "contains", "--set", "grpo.max_completion_length=8"], ["sft"]):
        result = invoke("finetune", *task, "--from", char_model, "--data", folder, "--steps", 1, "--dry-run")
        assert result.exit_code == 0, result.output
        assert "test.jsonl" in result.output, result.output


# --- model directories with configs that do not describe what tfcli would run ------------------------

CONFIGS = sorted((HOSTILE / "configs").glob("*.json"))


def tiny_directory(model_type: str, path: Path, changes: dict, build: dict | None = None) -> Path:
    """A tiny random model of `model_type` that transformers writes (the switches the family tests give
    it, and `build`), a small BPE tokenizer beside it, then config.json changed (a None removes a key)."""
    transformers = pytest.importorskip("transformers")
    from tfcli.data.tokenizers import load_tokenizer_files

    from .test_families import ARCHITECTURES as DENSE
    from .test_families import BASE
    from .test_gguf import small_gpt2
    from .test_moe import ARCHITECTURES as MIXTURES

    tok = load_tokenizer_files(small_gpt2(200), ["<|endoftext|>"])
    extra = {**DENSE, **MIXTURES}[model_type]
    layers = {"num_hidden_layers": 3, "num_experts_per_tok": 2} if model_type in MIXTURES else {}
    shape = {**BASE, **extra, **layers, "vocab_size": tok.vocab_size, **(build or {})}
    config = transformers.AutoConfig.for_model(model_type, **shape)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tok.tok.save(str(path / "tokenizer.json"))
    raw = json.loads((path / "config.json").read_text())
    raw.update(changes)
    (path / "config.json").write_text(json.dumps({k: v for k, v in raw.items() if v is not None}))
    return path


@pytest.mark.parametrize("case", CONFIGS, ids=[c.stem for c in CONFIGS])
def test_a_config_tfcli_would_run_otherwise_is_one_line(case, tmp_path):
    """tests/hostile/configs: a layer kind tfcli does not implement (which ran as full attention), a
    per-layer list shorter than the layers, a zero interval, a head_dim the weights disagree with, no
    experts, and exports llama.cpp's graphs would run differently."""
    spec = json.loads(case.read_text())
    model = tiny_directory(spec["model_type"], tmp_path / "m", spec["set"], spec.get("build"))
    if spec.get("command") == "export-gguf":
        result = invoke("export", "--checkpoint", model, "--gguf", tmp_path / "m.gguf")
        assert not (tmp_path / "m.gguf").exists()
    else:
        result = invoke("generate", "--checkpoint", model, "--prompt", "hi", "--max-new-tokens", 2)
    refused(result, *spec["says"])
    assert len(result.output.strip().splitlines()) == 1, result.output


def test_a_gguf_whose_expert_count_disagrees_with_its_tensors_names_both(tmp_path):
    import gguf

    model = tiny_directory("qwen3_moe", tmp_path / "m", {}, {"mlp_only_layers": []})
    assert invoke("export", "--checkpoint", model, "--gguf", tmp_path / "m.gguf").exit_code == 0
    reader = gguf.GGUFReader(str(tmp_path / "m.gguf"), "r+")
    field = reader.fields["qwen3moe.expert_count"]
    field.parts[field.data[0]][0] = 3  # written in place: 3 experts said, 4 stacked
    del reader
    refused(
        invoke("generate", "--checkpoint", tmp_path / "m.gguf", "--prompt", "hi"),
        "qwen3moe.expert_count is 3",
        "stacks 4 experts",
    )


def test_a_bare_modernbert_model_is_a_base_whose_head_is_built_new(tmp_path, mnli_dir):
    """ModernBERT embedding models ship as a bare ModernBertModel: refused because "its weights do not fit"
    (head.dense.weight); it is a base, so its prediction head is initialised fresh, as BERT's pooler."""
    transformers = pytest.importorskip("transformers")
    from tfcli.data.tokenizers import load_tokenizer_files

    from .test_modernbert import SHAPE

    tok = load_tokenizer_files("builtin:bert-base-uncased", [])
    config = transformers.ModernBertConfig(**{**SHAPE, "vocab_size": tok.vocab_size})
    transformers.ModernBertModel(config).save_pretrained(tmp_path / "m")
    tok.tok.save(str(tmp_path / "m" / "tokenizer.json"))
    args = ["finetune", "mnli", "--from", tmp_path / "m", "--data", mnli_dir, "--train", "lora", "--steps", 2]
    args += ["--batch-size", 4, "--quiet", "--set", "data.seq_len=32", "--set", "finetune.eval_limit=4"]
    result = invoke(*args, "--out", tmp_path / "run")
    assert result.exit_code == 0, result.output
    first = invoke("eval", "--checkpoint", tmp_path / "run", "--limit", 4, "--quiet")
    again = invoke("eval", "--checkpoint", tmp_path / "run", "--limit", 4, "--quiet")
    assert first.exit_code == 0 and first.output == again.output, first.output  # the same fresh head each time


def test_a_grid_file_that_names_a_tools_file_is_refused_with_the_setting_that_names_it(tools_run, mark, tmp_path):
    grid = tmp_path / "grid.yaml"
    tools = f"calculator,{EVIL_TOOLS}:fn"
    grid.write_text(yaml.safe_dump({"tasks": "grpo", "from": str(tools_run), "set": {"grpo.tools": tools}}))
    result = invoke("compare", "--grid", grid, "--out", tmp_path / "study")
    refused(result, f"--set grpo.tools={tools}")
    assert not mark.exists() and not (tmp_path / "study").exists()
