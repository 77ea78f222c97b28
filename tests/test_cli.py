"""Each subcommand through Typer's CliRunner; user errors are one line and exit code 2."""

from __future__ import annotations

import subprocess
import sys

import pytest
from typer.testing import CliRunner

from tfcli.cli import app

from .conftest import tiny_gpt_recipe

runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, small_text):
    import yaml

    root = tmp_path_factory.mktemp("cli")
    recipe = root / "tiny.yaml"
    recipe.write_text(yaml.safe_dump(tiny_gpt_recipe(small_text)))
    result = invoke(
        "pretrain",
        "--recipe",
        recipe,
        "--out",
        root / "run",
        "--steps",
        12,
        "--lr",
        "2e-3",
        "--set",
        "train.eval_interval=6",
    )
    assert result.exit_code == 0, result.output
    return root / "run", result.output


def test_pretrain_reports_progress_and_how_to_generate(trained_run):
    run, output = trained_run
    assert "step     12/12" in output and "tok_per_s" in output and "mfu" in output
    assert f"tfcli generate --checkpoint {run}" in output
    config = (run / "config.yaml").read_text()
    assert "steps: 12" in config and "lr: 0.002" in config and "eval_interval: 6" in config
    from PIL import Image

    with Image.open(run / "curves.png") as curves:  # redrawn at each evaluation, whole
        assert curves.size == (770, 440)


def test_resume_extends_a_finished_run(trained_run, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(trained_run[0], run)
    result = invoke("pretrain", "--resume", run, "--steps", 14)
    assert result.exit_code == 0, result.output
    assert "resuming from step-0000012" in result.output and "step     14/14" in result.output


def test_generate_streams_text_after_the_prompt(trained_run):
    result = invoke(
        "generate", "--checkpoint", trained_run[0], "--prompt", "ROMEO:", "--max-new-tokens", 30, "--seed", 1
    )
    assert result.exit_code == 0, result.output
    assert result.output.startswith("ROMEO:") and len(result.output.strip()) > len("ROMEO:") + 10
    again = invoke(
        "generate", "--checkpoint", trained_run[0], "--prompt", "ROMEO:", "--max-new-tokens", 30, "--seed", 1
    )
    assert again.output == result.output  # seeded sampling is reproducible
    greedy = [
        invoke(
            "generate", "--checkpoint", trained_run[0], "--prompt", "ROMEO:", "--max-new-tokens", 20, "--greedy", *flag
        ).output
        for flag in ([], ["--no-cache"])
    ]
    assert greedy[0] == greedy[1]


def test_eval_reports_loss_and_perplexity(trained_run, small_text):
    result = invoke("eval", "--checkpoint", trained_run[0])
    assert result.exit_code == 0, result.output
    assert "loss" in result.output and "ppl" in result.output
    other = invoke("eval", "--checkpoint", trained_run[0], "--data", small_text, "--batches", 2)
    assert other.exit_code == 0, other.output


def test_recipes_list_and_show():
    listing = invoke("recipes")
    assert listing.exit_code == 0 and "gpt-shakespeare-char" in listing.output
    shown = invoke("recipes", "show", "gpt-mini")
    assert shown.exit_code == 0 and "n_layer: 4" in shown.output and "batch_size: 16" in shown.output


@pytest.mark.parametrize(
    "args,message",
    [
        (["pretrain", "--recipe", "nope"], "error: unknown recipe 'nope'"),
        (["pretrain", "--objective", "xyz"], "error: unknown objective 'xyz'"),
        (["pretrain", "--data", "/no/such/file.txt", "--steps", "1"], "error: data not found: /no/such/file.txt"),
        (["pretrain", "--set", "optim.lrr=1"], "error: optim.lrr: unknown key"),
        (["pretrain", "--set", "train.steps=ten"], "error: train.steps: expected an integer"),
        (["generate", "--checkpoint", "/no/such/run"], "error: --checkpoint /no/such/run: not found"),
        (["eval", "--checkpoint", "/no/such/run"], "error: --checkpoint /no/such/run: not found"),
        (["recipes", "show", "nope"], "error: unknown recipe 'nope'"),
        (["finetune", "no-such-task"], "error: unknown task 'no-such-task'"),
    ],
)
def test_user_errors_are_one_line_with_exit_code_2(args, message):
    result = invoke(*args)
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert lines == [lines[0]] and lines[0].startswith(message), result.output


def test_wrong_family_for_an_objective_is_named(tmp_path, small_text, write_recipe):
    raw = tiny_gpt_recipe(small_text)
    path = write_recipe(raw)
    result = invoke(
        "pretrain", "--objective", "clm", "--recipe", path, "--set", "objective=clm", "--set", "model.family=nonesuch"
    )
    assert result.exit_code == 2 and "model.family: unknown family 'nonesuch'" in result.output


def test_console_script_usage_errors_are_one_line():
    result = subprocess.run(
        [sys.executable, "-c", "from tfcli.cli import main; main()", "pretrain", "--bogus"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    assert result.stderr.strip() == "error: no such option: --bogus (--help lists the options)"
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("args", [["compare", "--task", "nonesuch", "--from", "x", "--out", "o"]])
def test_a_fresh_process_reaches_the_command_before_any_import_cycle(args, tmp_path):
    """In a process of its own (the console script), where nothing is imported yet: compare imported
    torch first from inside tfcli.adapters, and torch's import walked sys.modules, loading the lazy
    tfcli.recipe, which imports tfcli.adapters half-initialised (an internal error, not this one line)."""
    result = subprocess.run(
        [sys.executable, "-c", "from tfcli.cli import main; main()", *args],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert result.returncode == 2, result.stderr
    assert "internal error" not in result.stderr and result.stderr.startswith("error: ")


def test_every_subcommand_help_lists_its_options():
    for command in ("pretrain", "finetune", "eval", "generate"):
        result = invoke(command, "--help")
        assert result.exit_code == 0 and "--help" in result.output
    assert "[default: 200]" in invoke("generate", "--help").output
