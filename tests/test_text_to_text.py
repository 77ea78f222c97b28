"""MNLI the generative way: balanced seeded k-shot prompts, label-word scoring that agrees with the
training loss, text-to-text finetuning that learns (T5 and GPT), and the CLI end to end."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from typer.testing import CliRunner

from tfcli.cli import app
from tfcli.models.gpt import GPT, GPTConfig
from tfcli.models.t5 import T5, T5Config
from tfcli.recipe import load_resolved
from tfcli.tasks import prompts
from tfcli.tasks import text_to_text as t2t

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
        rows.append((a, b, y))
    return rows


def tokenizer():
    words = ["mnli", "premise", "hypothesis", "answer", ":", "the", *LABELS, *CUES,
             "cat", "dog", "man", "car", "tree", "house", "boat", "bird"]
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


def test_k_shot_prompt_puts_solved_examples_before_the_question_and_fits_the_budget():
    tok = tokenizer()
    reader = t2t.DecoderReader(tiny("gpt"), tok, LABELS)
    rows = synthetic_rows(30, 0)
    shots = prompts.balanced_shots([r[2] for r in rows], 3, 3, seed=0)
    demos = prompts.few_shot_prefix("mnli", rows, shots, LABELS)
    assert all(d.endswith(f"answer: {LABELS[rows[i][2]]}") for d, i in zip(demos, shots))
    query = reader.query("mnli", "the cat", "the dog surely man")
    ids, used = t2t.k_shot(reader, demos, query, budget=200)
    assert used == 3 and ids[-len(query):] == query
    assert ids[: len(tok.encode(demos[0]))] == tok.encode(demos[0])
    short, used = t2t.k_shot(reader, demos, query, budget=len(query) + 20)
    assert used == 1 and len(short) <= len(query) + 20  # only the demo nearest the question fits


@pytest.mark.parametrize("family", ["t5", "gpt"])
def test_label_scores_agree_with_the_training_loss(family):
    model, tok = tiny(family).eval(), tokenizer()
    reader = t2t.make_reader(family, model, tok, LABELS)
    rows = synthetic_rows(6, 1)
    ids = [reader.query("mnli", a, b, family == "gpt") for a, b, _ in rows]
    labels = [y for _, _, y in rows]
    with torch.no_grad():
        loss, _ = reader.loss(model, None, reader.batch(ids, labels))
    scores = t2t.score_all(reader, ids)
    n_tokens = sum(len(reader.answers[y]) for y in labels)
    assert abs(float(loss) - (-sum(scores[i, y] for i, y in enumerate(labels)) / n_tokens)) < 1e-4


def test_t5_answers_fill_the_sentinel_as_in_span_corruption():
    tok = tokenizer()
    reader = t2t.make_reader("t5", tiny("t5"), tok, LABELS)
    sentinel = tok.token_id(prompts.SENTINEL)
    query = reader.query("mnli", "the cat", "the dog never cat", cue=False)
    assert query[-2:] == [sentinel, tok.eos_id]  # "... <extra_id_0> </s>"
    for word, answer in zip(LABELS, reader.answers):
        assert answer == [sentinel, tok.token_id(word), tok.eos_id]  # "<extra_id_0> word </s>"
    batch = reader.batch([query], [2])
    assert batch["decoder_input_ids"][0, :2].tolist() == [tok.token_id("<pad>"), sentinel]


@pytest.mark.parametrize("family", ["t5", "gpt"])
def test_text_to_text_finetuning_learns_the_label_word(family):
    model, tok = tiny(family), tokenizer()
    reader = t2t.make_reader(family, model, tok, LABELS)
    train, test = synthetic_rows(256, 2), synthetic_rows(60, 3)
    encode = lambda rows: [reader.query("mnli", a, b, family == "gpt") for a, b, _ in rows]  # noqa: E731
    batches = t2t.ShuffledBatches(list(zip(encode(train), [y for *_, y in train])), reader.batch, 32, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(40):
        loss, _ = reader.loss(model, None, batches.next_batch())
        loss.backward()
        opt.step()
        opt.zero_grad()
    acc = (t2t.score_all(reader, encode(test)).argmax(1) == [y for *_, y in test]).mean()
    assert acc > 0.9


@pytest.fixture(scope="module")
def mnli_dir(tmp_path_factory) -> Path:
    """A small slice of ../shared/data/mnli."""
    src = Path(__file__).resolve().parents[2] / "shared" / "data" / "mnli"
    out = tmp_path_factory.mktemp("mnli")
    for split, n in (("train", 300), ("dev_matched", 30), ("dev_mismatched", 30)):
        lines = (src / f"{split}.jsonl").read_text().splitlines()[:n]
        (out / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    return out


def pretrained(tmp: Path, objective: str, model: dict) -> Path:
    """A two-step pretraining run of a tiny model (byte-level BPE of 400 tokens)."""
    src = Path(__file__).resolve().parents[2] / "shared" / "data" / "text" / "tinyshakespeare.txt"
    (tmp / "text.txt").write_text(src.read_text()[:30_000])
    raw = {"name": f"tiny-{objective}", "objective": objective, "model": model,
           "tokenizer": {"kind": "bpe", "vocab_size": 400, "train_chars": 30_000},
           "data": {"source": str(tmp / "text.txt"), "val_fraction": 0.1, "seq_len": 48},
           "train": {"steps": 2, "batch_size": 4, "log_interval": 1, "eval_interval": 2, "eval_batches": 1,
                     "ckpt_interval": 2, "device": "cpu"}}
    (tmp / "r.yaml").write_text(yaml.safe_dump(raw))
    result = CliRunner().invoke(app, ["pretrain", "--objective", objective, "--recipe", str(tmp / "r.yaml"),
                                      "--out", str(tmp / "run"), "--quiet"])
    assert result.exit_code == 0, result.output
    return tmp / "run"


@pytest.fixture(scope="module")
def t5_run(tmp_path_factory) -> Path:
    return pretrained(tmp_path_factory.mktemp("t5run"), "span",
                      {"family": "t5", "n_layer": 1, "n_head": 2, "d_model": 32, "d_ff": 64, "max_seq_len": 96})


def test_gpt_few_shot_and_finetune_through_the_cli(tmp_path, mnli_dir):
    run = pretrained(tmp_path, "clm", {"family": "gpt", "n_layer": 1, "n_head": 2, "d_model": 32, "max_seq_len": 160})
    few = CliRunner().invoke(app, ["eval", "mnli", "--checkpoint", str(run), "--data", str(mnli_dir),
                                   "--few-shot", "2", "--limit", "6"])
    assert few.exit_code == 0 and "majority class" in few.output, few.output
    ft = CliRunner().invoke(app, ["finetune", "mnli", "--from", str(run), "--data", str(mnli_dir), "--steps", "2",
                                  "--batch-size", "4", "--limit", "16", "--out", str(tmp_path / "ft"), "--quiet",
                                  "--set", "task.epochs=0", "--set", "task.eval_limit=6"])
    assert ft.exit_code == 0, ft.output
    assert load_resolved(tmp_path / "ft" / "config.yaml").name == "mnli-gpt-mini"  # the GPT default recipe
    ev = CliRunner().invoke(app, ["eval", "mnli", "--checkpoint", str(tmp_path / "ft"), "--limit", "6"])
    assert ev.exit_code == 0 and "dev_matched: accuracy" in ev.output, ev.output


def test_mnli_finetune_eval_and_few_shot_through_the_cli(t5_run, mnli_dir, tmp_path):
    runner = CliRunner()
    few = runner.invoke(app, ["eval", "mnli", "--checkpoint", str(t5_run), "--data", str(mnli_dir),
                              "--few-shot", "3", "--limit", "12"])
    assert few.exit_code == 0, few.output
    assert re.search(r"dev_matched: accuracy \d+\.\d\d% on 12 rows \(majority class \d+\.\d\d%\), [\d.]+ of 3 shots",
                     few.output), few.output  # percentages, as the finetuned report prints them
    refused = runner.invoke(app, ["eval", "mnli", "--checkpoint", str(t5_run), "--data", str(mnli_dir)])
    assert refused.exit_code == 2 and "--few-shot" in refused.output
    out = tmp_path / "ft"
    ft = runner.invoke(app, ["finetune", "mnli", "--from", str(t5_run), "--data", str(mnli_dir), "--steps", "3",
                             "--batch-size", "4", "--limit", "40", "--out", str(out), "--quiet",
                             "--set", "task.epochs=0", "--set", "task.eval_limit=8", "--set", "train.eval_interval=3"])
    assert ft.exit_code == 0, ft.output
    assert load_resolved(out / "config.yaml").name == "mnli-t5-mini"  # --from a t5 run picks the T5 recipe
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert any("dev_matched_acc" in r for r in records)
    ev = runner.invoke(app, ["eval", "mnli", "--checkpoint", str(out), "--limit", "10"])
    assert ev.exit_code == 0 and "dev_mismatched: accuracy" in ev.output, ev.output
