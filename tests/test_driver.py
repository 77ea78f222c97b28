"""driver.py: every input is checked before compute is spent or a directory is made, and each run
gets its own directory."""

from __future__ import annotations

from .conftest import invoke


def test_a_request_the_model_cannot_serve_is_refused_before_any_data_is_read(tmp_path, small_text, mnli_dir, hf_bert):
    from .conftest import pretrained_run

    gpt = pretrained_run(
        tmp_path,
        small_text,
        "clm",
        {"family": "gpt", "n_layer": 1, "n_head": 2, "d_model": 32, "d_ff": 64, "max_seq_len": 48},
    )
    for args, message in (
        (["eval", "mnli", "--checkpoint", gpt, "--cloze", "--data", mnli_dir], "--cloze reads a BERT's masked-LM head"),
        (
            [
                "finetune",
                "mnli",
                "--from",
                hf_bert,
                "--data",
                mnli_dir,
                "--head",
                "text",
                "--steps",
                1,
                "--out",
                tmp_path / "x",
            ],
            "a BERT cannot answer as text",
        ),
        (
            [
                "finetune",
                "mnli",
                "--from",
                gpt,
                "--data",
                mnli_dir,
                "--head",
                "classifier",
                "--pooling",
                "cls",
                "--steps",
                1,
                "--out",
                tmp_path / "y",
            ],
            "--pooling cls: a gpt classifier pools",
        ),
    ):
        result = invoke(*args)
        assert result.exit_code == 2, result.output
        assert result.output.strip().splitlines() == [
            next(l for l in result.output.splitlines() if l.startswith("error:"))
        ]
        assert message in result.output and "rows" not in result.output, result.output


def test_two_runs_of_a_recipe_started_in_the_same_second_get_their_own_directories(tmp_path, monkeypatch):
    """runs/<recipe>-<time> is to the second: a second run started within it (two commands in a script)
    gets a directory of its own."""
    import time

    from tfcli import recipe as recipes
    from tfcli.driver import new_run_dir

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(time, "strftime", lambda fmt, *a: "20260101-000000")
    rec = recipes.load("gpt-mini")
    first = new_run_dir(rec, None)
    (first / "checkpoints").mkdir(parents=True)
    second = new_run_dir(rec, None)
    assert second != first and not second.exists() and second.name.startswith(first.name)
