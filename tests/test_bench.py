"""Benchmarks scored by log-likelihood (tfcli/bench): each choice's log-likelihood equals a direct
transformers computation on the same weights and ids; the metrics and the results layout are
lm-evaluation-harness's; bad input is one line."""

from __future__ import annotations

import json

import pytest
import torch

from tfcli.bench import loglik, report, spec
from tfcli.data.tokenizers import load_tokenizer_files
from tfcli.engine.backbone import for_inference

from .conftest import hf_llama_dir, invoke

transformers = pytest.importorskip("transformers")

PIQA_ROWS = [
    ({"goal": "How do I dry wet shoes?", "sol1": "Stuff them with newspaper.", "sol2": "Put them in the freezer."}, 0),
    ({"goal": "Keep bread fresh", "sol1": "leave it in the sun", "sol2": "wrap it in a cloth bag"}, 1),
    ({"goal": "To open a jar,", "sol1": "run the lid under hot water.", "sol2": "put it in the fridge."}, 0),
]


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory):
    return hf_llama_dir(tmp_path_factory.mktemp("bench") / "llama", max_positions=256)


@pytest.fixture(scope="module")
def piqa_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("piqa")
    (root / "valid.jsonl").write_text("".join(json.dumps(r) + "\n" for r, _ in PIQA_ROWS))
    (root / "valid-labels.lst").write_text("".join(f"{y}\n" for _, y in PIQA_ROWS))
    return root


def assert_equal_transformers(hf_llama, requests, scores) -> None:
    """Each score is transformers' full forward pass over context + continuation on the same ids: the
    continuation's summed log-probability (1e-5) and whether each of its tokens is the argmax."""
    theirs = transformers.LlamaForCausalLM.from_pretrained(hf_llama).eval()
    for r, s in zip(requests, scores, strict=True):
        ids = torch.tensor([r.context + r.continuation])
        with torch.no_grad():
            logp = torch.log_softmax(theirs(ids).logits[0, :-1].float(), dim=-1)
        n = len(r.continuation)
        targets = ids[0, -n:]
        assert s.loglikelihood == pytest.approx(float(logp[-n:].gather(1, targets[:, None]).sum()), abs=1e-5)
        assert s.greedy == bool((logp[-n:].argmax(-1) == targets).all())


def test_each_choices_loglikelihood_equals_transformers_on_the_same_ids(hf_llama, piqa_dir):
    bench = spec.load("piqa")
    questions = spec.questions(bench, piqa_dir, 0)
    backbone = for_inference(hf_llama)
    requests = loglik.requests(backbone.tokenizer, questions, bench.target_delimiter)
    ours = loglik.score(backbone.model, requests, pad=0, batch_size=1)
    assert len(ours) == 6
    assert_equal_transformers(hf_llama, requests, ours)
    batched = loglik.score(backbone.model, requests, pad=0, batch_size=4)  # right-padded rows of other lengths
    assert [b.loglikelihood for b in batched] == pytest.approx([s.loglikelihood for s in ours], rel=1e-6)


def test_one_token_choices_read_from_one_context_row_equal_transformers(hf_llama):
    """MMLU's letters: the context runs once and each choice is read from its last position."""
    backbone = for_inference(hf_llama)
    questions = [
        spec.Question(f"Q{i}: which is right?\nA. x\nB. y\nAnswer:", ["A", "B", "C", "D"], 1) for i in range(5)
    ]
    requests = loglik.requests(backbone.tokenizer, questions, " ")
    assert all(len(r.continuation) == 1 for r in requests) and len(loglik._groups(requests)) == 5
    ours = loglik.score(backbone.model, requests, pad=0, batch_size=2)
    theirs = transformers.LlamaForCausalLM.from_pretrained(hf_llama).eval()
    for r, s in zip(requests, ours):
        with torch.no_grad():
            logp = torch.log_softmax(theirs(torch.tensor([r.context])).logits[0, -1].float(), dim=-1)
        assert s.loglikelihood == pytest.approx(float(logp[r.continuation[0]]), abs=1e-5)
        assert s.greedy == (int(logp.argmax()) == r.continuation[0])


def test_a_few_shot_prefix_runs_once_per_batch_and_every_choice_still_equals_transformers(hf_llama):
    """Three passes through the KV cache (the batch's common prefix, each question's context after
    it, left-padded, then the choices of several tokens) give what one full row gives."""
    backbone = for_inference(hf_llama)
    shots = "Solved: one plus one is two.\n\nSolved: two plus two is four.\n\n"
    questions = [
        spec.Question(shots + f"Question {'very ' * i}hard: {i} plus {i} is\nAnswer:", [" A", " six", "the answer"], 0)
        for i in range(4)
    ]
    requests = loglik.requests(backbone.tokenizer, questions, " ")
    widths = []
    backbone.model.register_forward_hook(lambda m, args, out: widths.append(tuple(args[0].shape)))
    ours = loglik.score(backbone.model, requests, pad=0, batch_size=12)
    prefix = len(backbone.tokenizer.encode(shots)) - 2  # the boundary's tokens may merge with the question's
    assert widths[0][0] == 1 and widths[0][1] >= prefix >= loglik.MIN_SHARED  # pass 1: the prefix, once
    assert widths[1][0] == 4 and widths[1][1] < 20  # pass 2: each question's own tokens
    assert sum(a * b for a, b in widths) < sum(len(r.context) + len(r.continuation) for r in requests) / 2
    assert_equal_transformers(hf_llama, requests, ours)


def test_choices_longer_than_their_context_are_rows_of_their_own_and_equal_transformers(hf_llama):
    """PIQA's shape: a short goal, long solutions. Each choice is one row (context and choice), the
    rows of a batch of other lengths left-padded."""
    backbone = for_inference(hf_llama)
    questions = [
        spec.Question(f"Goal {i}:", ["first fill the pot with cold water" + " and wait" * i, "no"], 0) for i in range(3)
    ]
    requests = loglik.requests(backbone.tokenizer, questions, " ")
    assert all(len(g) == 1 for g in loglik._groups(requests))
    ours = loglik.score(backbone.model, requests, pad=0, batch_size=4)
    assert_equal_transformers(hf_llama, requests, ours)


def test_encoding_moves_the_contexts_trailing_space_to_the_continuation(hf_llama):
    tok = for_inference(hf_llama).tokenizer
    context, continuation = loglik.encode_pair(tok, "Answer: ", "yes")
    assert context == tok.encode("Answer:") and continuation == tok.encode("Answer: yes")[len(context) :]


def test_metrics_are_lm_evaluation_harness_s():
    questions = [spec.Question("q", ["a", "bbbb"], 1), spec.Question("q", ["aa", "b"], 0)]
    scores = [
        loglik.Score(0, 0, -1.0, False),
        loglik.Score(0, 1, -2.0, False),  # acc wrong, acc_norm right
        loglik.Score(1, 0, -1.0, True),
        loglik.Score(1, 1, -3.0, False),
    ]
    rows = report.per_question(questions, scores)
    assert [r["acc"] for r in rows] == [0.0, 1.0] and [r["acc_norm"] for r in rows] == [1.0, 1.0]
    m = report.metrics(rows)
    assert m["acc,none"] == 0.5 and m["acc_norm,none"] == 1.0
    assert m["acc_stderr,none"] == pytest.approx(0.5)  # sample std (n-1) 0.7071 / sqrt(2)


def test_eval_piqa_writes_lm_eval_results_and_mmlu_groups_subjects(hf_llama, piqa_dir, tmp_path):
    out = tmp_path / "piqa.json"
    result = invoke("eval", "piqa", "--checkpoint", hf_llama, "--data", piqa_dir, "--out", out, "--limit", 1)
    assert result.exit_code == 0, result.output
    payload = json.loads(out.read_text())  # lm-evaluation-harness's sections, for the tools that read them
    piqa = payload["results"]["piqa"]
    assert {"acc,none", "acc_stderr,none", "acc_norm,none", "acc_norm_stderr,none"} <= set(piqa)
    assert piqa["acc_stderr,none"] == "N/A" and "NaN" not in out.read_text()  # one question: no stderr
    assert payload["n-samples"]["piqa"] == {"original": 3, "effective": 1} and payload["n-shot"]["piqa"] == 0
    assert payload["versions"]["piqa"] == 1.0 and payload["higher_is_better"]["piqa"] == {"acc": True, "acc_norm": True}
    config = payload["configs"]["piqa"]
    assert config["output_type"] == "multiple_choice" and config["doc_to_text"] == "Question: {{goal}}\nAnswer:"
    assert payload["group_subtasks"] == {"piqa": []}
    logged = invoke("eval", "piqa", "--checkpoint", hf_llama, "--data", piqa_dir, "--out", out, "--log-samples")
    assert logged.exit_code == 0, logged.output
    lines = [json.loads(x) for x in (tmp_path / "piqa_samples_piqa.jsonl").read_text().splitlines()]
    assert len(lines) == 3 and lines[0]["doc"] == {**PIQA_ROWS[0][0], "label": "0"} and lines[0]["target"] == 0
    assert len(lines[0]["filtered_resps"]) == 2 and lines[0]["arguments"][1][1] == " Put them in the freezer."
    mmlu = tmp_path / "mmlu"
    for split in ("dev", "test"):
        (mmlu / split).mkdir(parents=True)
        for subject in ("anatomy", "virology"):
            rows = [f"What is {i} plus one?,{i + 1},{i},{i + 2},{i + 3},A\n" for i in range(6)]
            (mmlu / split / f"{subject}_{split}.csv").write_text("".join(rows))
    bench = spec.load("mmlu")
    part = {p.name: p for p in bench.parts}
    rows = {
        name: report.per_question(
            spec.questions(part[name], mmlu, 2),
            [loglik.Score(q, c, -float(c), False) for q in range(6) for c in range(4)],
        )
        for name in ("mmlu_anatomy", "mmlu_virology")
    }
    results = report.grouped("mmlu", rows, {"mmlu_anatomy": "stem", "mmlu_virology": "other"})
    assert results["mmlu"]["acc,none"] == 1.0 and set(results) == {
        "mmlu",
        "mmlu_stem",
        "mmlu_other",
        "mmlu_anatomy",
        "mmlu_virology",
    }


@pytest.mark.parametrize(
    "args, message",
    [
        (["eval", "piqa,nope_bench"], "unknown benchmark"),
        (["eval", "mmlu_nosuchsubject"], "mmlu has no subject 'nosuchsubject'"),
        (["eval", "piqa", "--few-shot", "3"], "train.jsonl is missing (the train split"),
        (["eval", "hellaswag"], "unknown task or benchmark 'hellaswag'"),
        (["eval", "piqa", "--data", "missing-dir"], "--data missing-dir: not a directory"),
        (["eval", "piqa", "--batch-size", "many"], "--batch-size many: give a number >= 1 or auto"),
        (["eval", "gsm8k,piqa,nope_bench"], "unknown benchmark 'nope_bench'"),  # before gsm8k runs
    ],
)
def test_bad_benchmark_input_is_one_line(args, message, hf_llama, piqa_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    if "--data" not in args:
        args = [*args, "--data", str(piqa_dir)]
    result = invoke(*args, "--checkpoint", hf_llama)
    assert result.exit_code == 2 and message in result.output, result.output
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_an_encoder_is_refused_in_one_line(piqa_dir, tmp_path):
    bert = tmp_path / "bert"
    transformers.BertModel(
        transformers.BertConfig(
            vocab_size=30522, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32
        )
    ).save_pretrained(bert)
    tok = load_tokenizer_files("builtin:bert-base-uncased", [])
    tok.tok.save(str(bert / "tokenizer.json"))
    result = invoke("eval", "piqa", "--checkpoint", bert, "--data", piqa_dir, "--out", tmp_path / "x.json")
    assert result.exit_code == 2 and "needs a decoder or an encoder-decoder" in result.output, result.output
    assert not (tmp_path / "x.json").exists()


def test_a_t5_scores_the_context_with_its_encoder_and_the_choice_with_its_decoder(tmp_path, small_text):
    """Encoder-decoders: each choice's log-likelihood equals transformers' T5 on the same weights
    (the run's export), the context the encoder's input and the choice the labels."""
    from .conftest import pretrained_run

    run = pretrained_run(
        tmp_path,
        small_text,
        "span",
        {"family": "t5", "n_layer": 1, "n_head": 2, "d_model": 32, "d_ff": 64, "max_seq_len": 64},
    )
    assert invoke("export", "--checkpoint", run, "--hf", tmp_path / "hf").exit_code == 0
    backbone = for_inference(run)
    questions = [spec.Question("the king said", ["to the queen", "and then"], 0)]
    requests = loglik.requests(backbone.tokenizer, questions, " ")
    ours = loglik.score(backbone.model, requests, pad=0, batch_size=2)
    theirs = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path / "hf").eval()
    for r, s in zip(requests, ours):
        with torch.no_grad():
            logits = theirs(input_ids=torch.tensor([r.context]), labels=torch.tensor([r.continuation])).logits
        logp = torch.log_softmax(logits[0].float(), dim=-1)
        expected = float(logp.gather(1, torch.tensor(r.continuation)[:, None]).sum())
        assert s.loglikelihood == pytest.approx(expected, abs=1e-5)


@pytest.mark.slow  # the fast tier keeps this module's cheaper tests
def test_a_list_mixes_tasks_and_benchmarks_found_under_one_data_directory(hf_llama, piqa_dir, tmp_path, monkeypatch):
    """`tfcli eval gsm8k,piqa --data D`: D/gsm8k and D/piqa; gsm8k through its own scorer (exact
    match of a generated reply), piqa by log-likelihood, both in one results file."""
    monkeypatch.chdir(tmp_path)
    data = tmp_path / "data"
    (data / "gsm8k").mkdir(parents=True)
    rows = [{"question": f"What is {i} plus {i}?", "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}"} for i in range(2)]
    (data / "gsm8k" / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (data / "piqa").symlink_to(piqa_dir)
    out = tmp_path / "both.json"
    args = ("eval", "gsm8k,piqa", "--checkpoint", hf_llama, "--data", data, "--batch-size", "auto", "--out", out)
    result = invoke(*args)
    assert result.exit_code == 0, result.output
    payload = json.loads(out.read_text())
    gsm8k = payload["results"]["gsm8k"]  # its final-number scores named as lm-eval's GSM8K filters, with stderr
    for key in ("exact_match,strict-match", "exact_match_stderr,strict-match", "exact_match,flexible-extract"):
        assert key in gsm8k, gsm8k
    assert payload["n-samples"] == {"gsm8k": {"original": 2, "effective": 2}, "piqa": {"original": 3, "effective": 3}}
    assert payload["config"]["batch_size"] == "auto" and payload["config"]["batch_sizes"][0] >= 1
    assert (tmp_path / "both-gsm8k.json").is_file()  # the task's own files go beside --out


def test_auto_batch_size_is_the_largest_power_of_two_the_free_memory_holds(hf_llama, monkeypatch):
    model = for_inference(hf_llama).model
    requests = [loglik.Request(0, 0, list(range(100)), [1, 2])]
    monkeypatch.setattr(loglik, "_free_bytes", lambda device: 1 << 40)
    assert loglik.auto_batch_size(model, requests) == 64
    monkeypatch.setattr(loglik, "_free_bytes", lambda device: 1)
    assert loglik.auto_batch_size(model, requests) == 1
    monkeypatch.setattr(loglik, "_free_bytes", lambda device: 1 << 26)
    middle = loglik.auto_batch_size(model, requests, most=1 << 20)
    assert 1 < middle < 1 << 20 and middle & (middle - 1) == 0
    longer = [loglik.Request(0, 0, list(range(200)), [1, 2])]
    assert loglik.auto_batch_size(model, longer, most=1 << 20) < middle  # longer rows: fewer at once


def test_a_question_longer_than_the_model_is_one_line_with_the_sizes(piqa_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    short = hf_llama_dir(tmp_path / "short", max_positions=8)
    result = invoke("eval", "piqa", "--checkpoint", short, "--data", piqa_dir)
    assert result.exit_code == 2, result.output
    assert "piqa: a question of" in result.output and "does not fit the model's 8 positions" in result.output
    assert list(tmp_path.iterdir()) == [short]  # nothing written
