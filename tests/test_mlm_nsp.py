"""MLM + NSP: NSP balance and truly consecutive IsNext pairs, training lowers the loss (masking
statistics: test_sampler)."""

import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from tfcli.cli import app
from tfcli.data import segments, store
from tfcli.data.documents import open_source
from tfcli.data.tokenize_worker import split_sentences
from tfcli.data.tokenizers import build_tokenizer
from tfcli.objectives.mlm_nsp import SPECIAL_TOKENS

from .conftest import read_metrics, tiny_bert_recipe


@pytest.fixture(scope="module")
def corpus(small_text, tmp_path_factory):
    """The first 400 paragraphs of the text, each a document, in a sentence store."""
    text = small_text.read_text()
    root = tmp_path_factory.mktemp("corpus")
    paragraphs = [p for p in text.split("\n\n") if p.strip()][:400]
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": p}) + "\n" for p in paragraphs))
    tok = build_tokenizer("wordpiece", vocab_size=600, path="", lowercase=True, texts=[text], specials=SPECIAL_TOKENS)
    s = store.prepare(
        open_source(str(root / "docs.jsonl")), tok, root / "store", mode="sentences", eos=False, workers=1, quiet=True
    )
    return segments.Corpus(s, 0, s.n_docs)


def test_sentence_splitting():
    assert split_sentences("One. Two!  Three?\n\nFour\nstill four.") == ["One.", "Two!", "Three?", "Four\nstill four."]


def test_nsp_is_balanced_and_isnext_pairs_are_truly_consecutive(corpus):
    rng = np.random.default_rng(0)
    pairs = [
        segments.pair_at(corpus, at, 61, np.random.default_rng([0, at]))
        for at in rng.integers(0, corpus.n_tokens, size=600)
    ]
    labels = np.array([p[2] for p in pairs])
    assert abs(labels.mean() - 0.5) < 0.06
    docs = [
        np.asarray(
            corpus.store.tokens[corpus.sentence_start(r.start) : corpus.sentence_start(r.stop)], dtype=np.int64
        ).tobytes()
        for r in (corpus.doc_sentences(d) for d in range(corpus.n_docs))
    ]
    for a, b, label in pairs:
        assert len(a) >= 1 and len(b) >= 1 and len(a) + len(b) <= 61
        joined = np.concatenate([a, b]).tobytes()
        found = any(joined in d for d in docs)
        if label == 0:
            assert found, "an IsNext pair is not consecutive text of one document"
    not_next = [np.concatenate([a, b]).tobytes() for a, b, l in pairs if l == 1]
    assert sum(any(j in d for d in docs) for j in not_next) < 0.02 * len(not_next)


def test_full_segments_pack_whole_sentences_from_a_sentence_start(corpus):
    starts = [corpus.sentence_start(s) for s in range(corpus.first_sentence, corpus.last_sentence)]
    for at in np.random.default_rng(1).integers(0, corpus.n_tokens, size=200):
        seg = segments.segment_at(corpus, int(at), 40, sep_id=3)
        assert 0 < len(seg) <= 40
        first = corpus.sentence_at(int(at))
        assert np.array_equal(seg[: len(corpus.sentence(first))], corpus.sentence(first)[:40])  # begins a sentence
    lengths = [len(segments.segment_at(corpus, int(at), 40, 3)) for at in range(0, corpus.n_tokens, 40)]
    assert np.mean(lengths) > 25 and len(starts) > 100  # packed, not one sentence each


def _tiny_bert_recipe(data, nsp=True) -> dict:
    return tiny_bert_recipe(data, mlm={"nsp": nsp})


def test_pretrain_mlm_lowers_the_loss_and_reports_all_metrics(small_text, write_recipe, tmp_path):
    path = write_recipe(_tiny_bert_recipe(small_text))
    out = tmp_path / "run"
    result = CliRunner().invoke(
        app, ["pretrain", "--objective", "mlm", "--recipe", str(path), "--out", str(out), "--quiet"]
    )
    assert result.exit_code == 0, result.output
    rows = [r for r in read_metrics(out) if r.get("split") == "train"]
    assert {"mlm_loss", "mlm_acc", "nsp_loss", "nsp_acc"} <= set(rows[0])
    assert rows[-1]["mlm_loss"] < rows[0]["mlm_loss"] - 0.3  # from ln(400) = 6.0 towards the unigram entropy
    val = [r for r in read_metrics(out) if r.get("split") == "val"][-1]
    assert 0.0 <= val["nsp_acc"] <= 1.0 and val["mlm_loss"] > 0
    meta = json.loads((out / "checkpoints" / "step-0000030" / "meta.json").read_text())
    assert meta["family"] == "bert"


def test_no_nsp_trains_mlm_only(small_text, write_recipe, tmp_path):
    raw = _tiny_bert_recipe(small_text)
    raw["train"]["steps"] = 6
    out = tmp_path / "run"
    result = CliRunner().invoke(
        app,
        [
            "pretrain",
            "--objective",
            "mlm",
            "--no-nsp",
            "--recipe",
            str(write_recipe(raw)),
            "--out",
            str(out),
            "--quiet",
        ],
    )
    assert result.exit_code == 0, result.output
    rows = read_metrics(out)
    assert "mlm_loss" in rows[0] and "nsp_loss" not in rows[0]


def test_no_nsp_is_refused_for_other_objectives():
    result = CliRunner().invoke(app, ["pretrain", "--objective", "clm", "--no-nsp"])
    assert result.exit_code == 2 and "--no-nsp" in result.output


@pytest.mark.slow
def test_resumed_mlm_run_ends_with_the_same_weights(small_text, write_recipe, tmp_path):
    from tfcli.engine.checkpoint import find, load_weights

    text = small_text.read_text()
    tok = build_tokenizer("wordpiece", vocab_size=400, path="", lowercase=True, texts=[text], specials=SPECIAL_TOKENS)
    tok.save(tmp_path)  # one tokenizer for both runs (WordPiece training breaks ties differently run to run)
    raw = _tiny_bert_recipe(small_text)
    raw["tokenizer"] = {"kind": "file", "path": str(tmp_path / "tokenizer.json")}
    raw["schedule"]["decay"] = "constant"  # the schedule then does not depend on the total steps
    raw["train"].update(steps=6, ckpt_interval=3, eval_interval=3, log_interval=3)
    path = write_recipe(raw)
    straight, split = tmp_path / "a", tmp_path / "b"
    run = lambda *extra: CliRunner().invoke(
        app, ["pretrain", "--objective", "mlm", "--recipe", str(path), "--quiet", *extra]
    )
    assert run("--out", str(straight)).exit_code == 0
    assert run("--out", str(split), "--steps", "3").exit_code == 0
    result = CliRunner().invoke(
        app, ["pretrain", "--objective", "mlm", "--resume", str(split), "--steps", "6", "--quiet"]
    )
    assert result.exit_code == 0, result.output
    a, b = load_weights(find(straight)), load_weights(find(split))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
