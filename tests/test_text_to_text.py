"""MNLI the generative way: balanced seeded k-shot prompts, label-word scoring that agrees with the
training loss, text-to-text finetuning that learns (T5 and GPT), and the CLI end to end."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from tfcli.cli import app
from tfcli.data.sampler import Sampler, sequential_batches
from tfcli.models.gpt import GPT, GPTConfig
from tfcli.models.t5 import T5, T5Config
from tfcli.recipe import load_resolved
from tfcli.tasks import prompts
from tfcli.tasks.text_to_text import TextHead

from .conftest import pretrained_run

FIELDS = ("premise", "hypothesis")

LABELS = ("entailment", "neutral", "contradiction")
CUES = ("surely", "perhaps", "never")  # the synthetic task: the hypothesis's cue word decides the label


class WordTokenizer:
    """A whitespace tokenizer over a fixed vocabulary, with T5's special tokens."""

    def __init__(self, words):
        specials = ["<pad>", "</s>", "<unk>", prompts.SENTINEL]
        self.vocab = {w: i for i, w in enumerate(dict.fromkeys(specials + list(words)))}
        self.eos_id = self.vocab["</s>"]

    def token_id(self, token):
        return self.vocab.get(token)

    def encode(self, text):
        return [self.vocab.get(w, 2) for w in text.replace(":", " :").split()]


def synthetic_rows(n, seed):
    rng = np.random.default_rng(seed)
    nouns = ["cat", "dog", "man", "car", "tree", "house", "boat", "bird"]
    rows = []
    for _ in range(n):
        y = int(rng.integers(3))
        a = " ".join(rng.choice(nouns, size=5))
        b = f"the {rng.choice(nouns)} {CUES[y]} {rng.choice(nouns)}"
        rows.append(((a, b), y))
    return rows


def tokenizer():
    words = [
        "mnli",
        "premise",
        "hypothesis",
        "answer",
        ":",
        "the",
        *LABELS,
        *CUES,
        "cat",
        "dog",
        "man",
        "car",
        "tree",
        "house",
        "boat",
        "bird",
    ]
    return WordTokenizer(words)


def tiny(family):
    torch.manual_seed(0)
    if family == "t5":
        return T5(T5Config(n_layer=2, n_head=4, d_model=32, d_ff=64, vocab_size=40, max_seq_len=40))
    return GPT(GPTConfig(n_layer=2, n_head=4, d_model=32, d_ff=64, vocab_size=40, max_seq_len=40))


def test_k_shots_are_balanced_seeded_and_distinct():
    labels = np.random.default_rng(0).integers(0, 3, size=300).tolist()
    shots = prompts.balanced_shots(labels, 8, 3, seed=4)
    assert len(shots) == len(set(shots)) == 8
    counts = np.bincount([labels[i] for i in shots], minlength=3)
    assert sorted(counts.tolist()) == [2, 3, 3]
    assert shots == prompts.balanced_shots(labels, 8, 3, seed=4)
    assert shots != prompts.balanced_shots(labels, 8, 3, seed=5)
    assert np.bincount([labels[i] for i in prompts.balanced_shots(labels, 9, 3, seed=1)]).tolist() == [3, 3, 3]


def head(family, model=None, cue=True, demos=(), budget=200):
    return TextHead(model or tiny(family), tokenizer(), "mnli", FIELDS, LABELS, budget, cue, list(demos))


def test_k_shot_prompt_puts_solved_examples_before_the_question_and_fits_the_budget():
    tok = tokenizer()
    rows = synthetic_rows(30, 0)
    shots = prompts.balanced_shots([y for _, y in rows], 3, 3, seed=0)
    demos = prompts.few_shot_prefix("mnli", FIELDS, rows, shots, LABELS)
    assert all(d.endswith(f"answer: {LABELS[rows[i][1]]}") for d, i in zip(demos, shots))
    texts = ("the cat", "the dog surely man")
    model = GPT(
        GPTConfig(n_layer=1, n_head=2, d_model=16, vocab_size=40, max_seq_len=256)
    )  # the budget, not the context, limits
    query = head("gpt", model).prompt(texts)
    ids = head("gpt", model, demos=demos).prompt(texts)
    assert ids[-len(query) :] == query and ids[: len(tok.encode(demos[0]))] == tok.encode(demos[0])
    budget = len(query) + max(len(tok.encode(d + "\n")) for d in demos) + 1
    short = head("gpt", model, demos=demos, budget=budget)
    ids = short.prompt(texts)
    assert short.shots_used == [1] and len(ids) <= budget  # only the demo nearest the question fits


@pytest.mark.parametrize("family", ["t5", "gpt"])
def test_label_scores_agree_with_the_training_loss(family):
    model = tiny(family).eval()
    h = head(family, model, cue=family == "gpt")
    rows = synthetic_rows(6, 1)
    with torch.no_grad():
        loss, _ = h.loss(model, None, next(sequential_batches(h.source(rows, train=True), 6, 0)))
        scores = h.scores(model, None, next(sequential_batches(h.source(rows, train=False), 6, 0)))
    n_tokens = sum(len(h.reader.answers[y]) for _, y in rows)
    assert abs(float(loss) - (-sum(scores[i, y] for i, (_, y) in enumerate(rows)) / n_tokens)) < 1e-4


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_decoder_label_scores_read_the_prompt_once_and_equal_one_pass_per_label(family):
    """The shared-prompt scoring (KV cache, left padding, rewound per label) against the plain sum of
    each label's token log-probabilities after each prompt, labels of one, two and three tokens."""
    from tfcli.models.llama import Llama, LlamaConfig
    from tfcli.tasks.text_to_text import DecoderReader

    torch.manual_seed(0)
    model = (
        GPT(GPTConfig(n_layer=2, n_head=4, d_model=32, d_ff=64, vocab_size=40, max_seq_len=40))
        if family == "gpt"
        else Llama(LlamaConfig(n_layer=2, n_head=4, n_kv_head=2, d_model=32, d_ff=64, vocab_size=40, max_seq_len=40))
    ).eval()
    tok = tokenizer()
    reader = DecoderReader(tok, ("cat", "the dog", "the tree house"))
    prompts_ = [
        tok.encode("mnli premise : the cat answer :"),
        tok.encode("the dog man answer :"),
        tok.encode("answer :"),
    ]
    with torch.no_grad():
        scores = reader.scores(model, prompts_)  # (3, 3)
        for i, p in enumerate(prompts_):
            for j, a in enumerate(reader.answers):
                logp = model.logits(model(torch.tensor([p + a[:-1]]))).log_softmax(-1)[0, len(p) - 1 :]  # (A, V)
                assert abs(float(scores[i, j]) - float(logp.gather(1, torch.tensor(a)[:, None]).sum())) < 1e-4


def test_t5_answers_fill_the_sentinel_as_in_span_corruption():
    tok = tokenizer()
    h = head("t5", cue=False)
    sentinel = tok.token_id(prompts.SENTINEL)
    query = h.prompt(("the cat", "the dog never cat"))
    assert query[-2:] == [sentinel, tok.eos_id]  # "... <extra_id_0> </s>"
    for word, answer in zip(LABELS, h.reader.answers):
        assert answer == [sentinel, tok.token_id(word), tok.eos_id]  # "<extra_id_0> word </s>"
    batch = h.reader.batch([query], [2])
    assert batch["decoder_input_ids"][0, :2].tolist() == [tok.token_id("<pad>"), sentinel]


@pytest.mark.parametrize("family", ["t5", "gpt"])
def test_text_to_text_finetuning_learns_the_label_word(family):
    model = tiny(family)
    h = head(family, model, cue=family == "gpt")
    train, test = synthetic_rows(256, 2), synthetic_rows(60, 3)
    batches = Sampler(h.source(train, train=True), 32, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(40):
        loss, _ = h.loss(model, None, batches.next_batch())
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    with torch.no_grad():
        scores = h.scores(model, None, next(sequential_batches(h.source(test, train=False), 60, 0)))
    assert (scores.argmax(1).numpy() == [y for _, y in test]).mean() > 0.9


@pytest.fixture(scope="module")
def t5_run(tmp_path_factory, small_text) -> Path:
    return pretrained_run(
        tmp_path_factory.mktemp("t5run"),
        small_text,
        "span",
        {"family": "t5", "n_layer": 1, "n_head": 2, "d_model": 32, "d_ff": 64, "max_seq_len": 96},
    )


def test_gpt_few_shot_and_finetune_through_the_cli(tmp_path, mnli_dir, small_text):
    run = pretrained_run(
        tmp_path, small_text, "clm", {"family": "gpt", "n_layer": 1, "n_head": 2, "d_model": 32, "max_seq_len": 160}
    )
    few = CliRunner().invoke(
        app, ["eval", "mnli", "--checkpoint", str(run), "--data", str(mnli_dir), "--few-shot", "2", "--limit", "6"]
    )
    assert few.exit_code == 0 and "majority class" in few.output, few.output
    ft = CliRunner().invoke(
        app,
        [
            "finetune",
            "mnli",
            "--from",
            str(run),
            "--data",
            str(mnli_dir),
            "--steps",
            "2",
            "--batch-size",
            "4",
            "--limit",
            "16",
            "--out",
            str(tmp_path / "ft"),
            "--quiet",
            "--set",
            "finetune.eval_limit=6",
        ],
    )
    assert ft.exit_code == 0, ft.output
    assert load_resolved(tmp_path / "ft" / "config.yaml").name == "mnli-gpt-mini"  # the GPT default recipe
    ev = CliRunner().invoke(app, ["eval", "mnli", "--checkpoint", str(tmp_path / "ft"), "--limit", "6"])
    assert ev.exit_code == 0 and "dev_matched: accuracy" in ev.output, ev.output


def test_mnli_finetune_eval_and_few_shot_through_the_cli(t5_run, mnli_dir, tmp_path):
    runner = CliRunner()
    few = runner.invoke(
        app, ["eval", "mnli", "--checkpoint", str(t5_run), "--data", str(mnli_dir), "--few-shot", "3", "--limit", "12"]
    )
    assert few.exit_code == 0, few.output
    assert re.search(
        r"dev_matched: accuracy \d+\.\d\d% on 12 rows \(majority class \d+\.\d\d%\), [\d.]+ of 3 shots", few.output
    ), few.output  # percentages, as the finetuned report prints them
    refused = runner.invoke(app, ["eval", "mnli", "--checkpoint", str(t5_run), "--data", str(mnli_dir)])
    assert refused.exit_code == 2 and "--few-shot" in refused.output
    out = tmp_path / "ft"
    ft = runner.invoke(
        app,
        [
            "finetune",
            "mnli",
            "--from",
            str(t5_run),
            "--data",
            str(mnli_dir),
            "--steps",
            "3",
            "--batch-size",
            "4",
            "--limit",
            "40",
            "--out",
            str(out),
            "--quiet",
            "--set",
            "finetune.eval_limit=8",
            "--set",
            "train.eval_interval=3",
        ],
    )
    assert ft.exit_code == 0, ft.output
    assert load_resolved(out / "config.yaml").name == "mnli-t5-mini"  # --from a t5 run picks the T5 recipe
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert any("dev_matched_acc" in r for r in records)
    ev = runner.invoke(app, ["eval", "mnli", "--checkpoint", str(out), "--limit", "10"])
    assert ev.exit_code == 0 and "dev_mismatched: accuracy" in ev.output, ev.output
