"""engine/backbone.py: a run starts from the weights it is given (a tfcli run, a Hugging Face
directory), and generate reads what eval reads."""

from __future__ import annotations

import json

from .conftest import invoke, read_metrics
from .test_cli_behaviour import gpt_run


def test_continued_pretraining_starts_from_the_weights_it_is_given(tmp_path, small_text, hf_bert, hf_bert_mlm):
    """pretrain --from: a GPT run continues next-token training where it stopped (the objective
    follows the family); a BERT without an MLM head gets fresh heads, named in one line."""
    source = gpt_run(tmp_path, small_text, "source", steps=30, ckpt_interval=30, eval_interval=30)
    ended = [m["loss"] for m in read_metrics(source) if m.get("split") == "train"][-1]
    result = invoke(
        "pretrain",
        "--from",
        source,
        "--data",
        small_text,
        "--steps",
        1,
        "--out",
        tmp_path / "more",
        "--set",
        "schedule.warmup_steps=0",
        "--set",
        "data.seq_len=32",
        "--set",
        "train.log_interval=1",
    )
    assert result.exit_code == 0, result.output
    first = [m["loss"] for m in read_metrics(tmp_path / "more") if m.get("split") == "train"][0]
    assert abs(first - ended) < 0.3 and first < 3.7, (first, ended)  # a fresh model starts near ln(65) = 4.2
    assert json.loads((tmp_path / "more" / "run.json").read_text())["from"] == str(source.resolve())
    text = tmp_path / "paragraphs.txt"
    text.write_text("\n\n".join(small_text.read_text()[i : i + 400] for i in range(0, 20_000, 400)))
    for model, missing in ((hf_bert, "mlm and nsp heads"), (hf_bert_mlm, "nsp head")):
        result = invoke(
            "pretrain",
            "--objective",
            "mlm",
            "--from",
            model,
            "--data",
            text,
            "--steps",
            1,
            "--batch-size",
            4,
            "--out",
            tmp_path / model.name,
            "--set",
            "data.seq_len=64",
        )
        assert result.exit_code == 0, result.output
        assert f"has no weights for the objective's {missing}; initialised as a new run's" in " ".join(
            result.output.split()
        )


def test_generate_takes_a_hugging_face_directory_as_eval_does(tmp_path, small_text):
    """`generate --checkpoint` reads what `eval --checkpoint` reads: a run's export generates the same
    greedy text as the run."""
    run = gpt_run(tmp_path, small_text)
    assert invoke("export", "--checkpoint", run, "--hf", tmp_path / "hf").exit_code == 0
    texts = [
        invoke("generate", "--checkpoint", where, "--prompt", "ROMEO:", "--max-new-tokens", 12, "--greedy")
        for where in (run, tmp_path / "hf")
    ]
    assert all(t.exit_code == 0 for t in texts), [t.output for t in texts]
    assert texts[0].output.strip().splitlines()[-1] == texts[1].output.strip().splitlines()[-1]
    missing = invoke("generate", "--checkpoint", tmp_path / "nothing-here", "--prompt", "x")
    assert missing.exit_code == 2 and missing.output.startswith("error:")
