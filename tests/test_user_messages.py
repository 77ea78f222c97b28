"""Messages that help: each names the problem and what to do, in one line with exit code 2;
`tfcli --help` answers without importing torch; `finetune --help` names every task."""

from __future__ import annotations

import subprocess
import sys

from .conftest import REPO, invoke, write_jsonl
from .test_from_runs import chat_model, sft_lora  # noqa: F401  (fixtures)


def test_an_sft_file_whose_fields_are_misspelled_names_the_fields_it_has_and_the_flags(chat_model, tmp_path):  # noqa: F811
    data = write_jsonl(tmp_path / "rows.jsonl", [{"question": f"q{i}", "answer": f"a{i}"} for i in range(16)])
    result = invoke(
        "finetune", "sft", "--from", chat_model, "--data", data, "--steps", 1, "--out", tmp_path / "run", "--quiet"
    )
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1, result.output
    assert "'question', 'answer'" in result.output and "--prompt-field" in result.output, result.output
    assert not (tmp_path / "run").exists()


def test_plot_of_a_metric_no_run_logged_lists_the_ones_they_have(sft_lora, tmp_path):  # noqa: F811
    result = invoke("plot", sft_lora, "--metric", "nonexistent", "--out", tmp_path / "x.png")
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1, result.output
    assert "no run logged it" in result.output and "loss" in result.output, result.output
    assert not (tmp_path / "x.png").exists()
    result = invoke("plot", sft_lora, sft_lora, "--metric", "nonexistent", "--out", tmp_path / "x.png")
    assert result.exit_code == 2 and not (tmp_path / "x.png").exists()


def test_eval_mnli_scores_the_splits_a_directory_holds(hf_bert, mnli_dir, tmp_path):
    only = tmp_path / "only-matched"
    only.mkdir()
    (only / "dev_matched.jsonl").write_text((mnli_dir / "dev_matched.jsonl").read_text())
    run = tmp_path / "run"
    assert (
        invoke(
            "finetune",
            "mnli",
            "--from",
            hf_bert,
            "--data",
            mnli_dir,
            "--steps",
            1,
            "--batch-size",
            4,
            "--out",
            run,
            "--quiet",
            "--set",
            "finetune.eval_limit=4",
        ).exit_code
        == 0
    )
    result = invoke("eval", "--checkpoint", run, "--data", only, "--limit", 6)
    assert result.exit_code == 0, result.output
    assert "no dev_mismatched file" in result.output and "dev_matched: accuracy" in result.output, result.output
    empty = tmp_path / "empty"
    empty.mkdir()
    result = invoke("eval", "--checkpoint", run, "--data", empty)
    assert result.exit_code == 2 and "no evaluation split file" in result.output, result.output


def test_help_answers_without_importing_torch_and_names_every_task():
    code = "import sys, tfcli.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert out.stdout.strip() == "False", out.stderr
    from tfcli.registry import TASKS
    from tfcli.tasks.presets import PRESETS

    text = " ".join(invoke("finetune", "--help").output.split())
    assert all(name in text for name in [*TASKS, *PRESETS]), text


def test_ctrl_c_in_chat_stops_the_reply_and_returns_to_the_prompt(chat_model, monkeypatch):  # noqa: F811
    from tfcli import generate

    def interrupted(backbone, template, messages, **sampling):
        yield "Once upon"
        if len(messages) == 1:  # the first reply is interrupted; the second is whole
            raise KeyboardInterrupt
        yield " a time."

    monkeypatch.setattr(generate, "reply", interrupted)
    result = invoke("chat", "--checkpoint", chat_model, input="tell me a story\nagain\n")
    assert result.exit_code == 0, result.output
    assert "Once upon [stopped]\nOnce upon a time.\n" in result.output, result.output


def test_the_sft_example_marks_its_trained_tokens_in_plain_text_when_piped(chat_model, tmp_path):  # noqa: F811
    data = write_jsonl(
        tmp_path / "rows.jsonl",
        [{"prompt": f"What is {i} plus 1?", "completion": f"It is {i + 1}."} for i in range(16)],
    )
    result = invoke("finetune", "sft", "--from", chat_model, "--data", data, "--steps", 1, "--out", tmp_path / "run")
    assert result.exit_code == 0, result.output
    assert "[[It is" in result.output and "<|im_end|>]]" in result.output, result.output
