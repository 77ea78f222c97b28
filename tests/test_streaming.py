"""Streaming (data.streaming): blocks in stream order through the shuffle buffer, a position that
survives a checkpoint (buffer and draws included) so a resumed run continues bit for bit, the same
global order for any number of processes, and one-line refusals where streaming does not apply."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from tfcli.data.documents import open_source
from tfcli.data.sampler import StreamSampler
from tfcli.data.streaming import BlockStream
from tfcli.data.tokenizers import build_tokenizer
from tfcli.engine import checkpoint
from tfcli.objectives.next_token import shifted_pairs

from .conftest import invoke, tiny_gpt_recipe, train_losses

_WORDS = "lorem ipsum dolor sit amet consectetur adipiscing elit sed do eiusmod tempor".split()
DOCS = [f"document {i}: " + " ".join(np.random.default_rng(i).choice(_WORDS, size=5 + i % 7)) for i in range(40)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("stream")
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    tok = build_tokenizer("char", vocab_size=0, path="", lowercase=False, texts=DOCS, specials=["<|endoftext|>"])
    return open_source(str(root / "docs.jsonl")), tok


def stream(corpus, buffer=8, seed=0, held_out=0):
    source, tok = corpus
    return BlockStream(source, tok, 17, buffer, seed, shifted_pairs, held_out)


def test_without_shuffling_the_blocks_are_the_token_stream_in_order(corpus):
    _, tok = corpus
    s = stream(corpus, buffer=1)
    expected = np.concatenate([tok.encode(d) + [tok.eos_id] for d in DOCS])
    got = np.concatenate(s.next_examples(50))
    assert np.array_equal(got, expected[: len(got)])


def roundtrip(state: dict) -> dict:
    """A state written as a checkpoint's training state (JSON + tensors) and read back, as a resumed run reads it."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        checkpoint.write_state(Path(tmp), state)
        return checkpoint.load_state(Path(tmp))


def test_a_resumed_stream_continues_exactly_across_epochs(corpus):
    a = StreamSampler(stream(corpus), batch_size=4, seed=3)
    for _ in range(60):  # several passes over the 40 short documents
        a.next_batch()
    assert a.stream.epoch >= 1
    b = StreamSampler(stream(corpus), batch_size=4, seed=3)
    b.load_state_dict(roundtrip(a.state_dict()))
    for _ in range(10):
        x, y = a.next_batch(), b.next_batch()
        assert all(torch.equal(x[k], y[k]) for k in x)


def test_ranks_split_the_same_global_stream(corpus):
    one = StreamSampler(stream(corpus), batch_size=6, seed=0)
    ranks = [StreamSampler(stream(corpus), batch_size=3, seed=0, rank=r, world_size=2) for r in (0, 1)]
    for _ in range(5):
        whole = one.next_batch()["input_ids"]
        halves = torch.cat([r.next_batch()["input_ids"] for r in ranks])
        assert torch.equal(whole, halves)


def test_the_held_out_blocks_are_not_trained_on_in_the_first_pass(corpus):
    held = stream(corpus, buffer=1).first_blocks(5)
    s = stream(corpus, buffer=1, held_out=5)
    assert not any(np.array_equal(h, b) for h in held for b in s.next_examples(20))


def test_a_streamed_run_resumes_bit_for_bit(tmp_path, corpus, write_recipe):
    source, _ = corpus
    raw = tiny_gpt_recipe(source.files[0], train={"steps": 8, "ckpt_interval": 4, "eval_interval": 4})
    raw["data"].update({"streaming": True, "shuffle_buffer": 16, "seq_len": 16})
    path = write_recipe(raw)
    assert invoke("pretrain", "--recipe", path, "--out", tmp_path / "whole", "--quiet").exit_code == 0
    cut = tmp_path / "cut"
    shutil.copytree(tmp_path / "whole", cut)
    shutil.rmtree(cut / "checkpoints" / "step-0000008")
    (cut / "checkpoints" / "latest").write_text("step-0000004")
    result = invoke("pretrain", "--resume", cut, "--quiet")
    assert result.exit_code == 0, result.output
    a, b = train_losses(tmp_path / "whole"), train_losses(cut)
    assert [b[s] for s in range(5, 9)] == [a[s] for s in range(5, 9)]


def test_streaming_is_refused_where_it_does_not_apply(tmp_path, small_text):
    result = invoke(
        "pretrain",
        "--objective",
        "mlm",
        "--data",
        small_text,
        "--set",
        "data.streaming=true",
        "--out",
        tmp_path / "run",
    )
    assert result.exit_code == 2 and "streaming is for clm and span" in result.output
    assert not (tmp_path / "run").exists()
