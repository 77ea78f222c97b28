"""Document-aware packing: with data.document_mask a packed block's loss is exactly the loss of its
documents run alone (block-diagonal causal attention, positions restarting per document, no target
across a boundary); without it, documents see each other."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tfcli.data import store
from tfcli.data.documents import open_source
from tfcli.data.packing import BlockSource, TokenSpan, documents_from_eos
from tfcli.data.sampler import Draw
from tfcli.data.tokenizers import build_tokenizer
from tfcli.models.gpt import GPT, GPTConfig, document_positions
from tfcli.objectives.losses import IGNORE
from tfcli.objectives.next_token import shifted_pairs

from .conftest import invoke, read_metrics, tiny_gpt_recipe

DOCS = ["the cat sat", "a dog ran far away", "birds sing", "x"]


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    root = tmp_path_factory.mktemp("packed")
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    tok = build_tokenizer("char", vocab_size=0, path="", lowercase=False, texts=DOCS, specials=["<|endoftext|>"])
    s = store.prepare(open_source(str(root / "docs.jsonl")), tok, root / "store", workers=1, quiet=True)
    return s, tok


def test_positions_restart_at_each_document():
    docs = torch.tensor([[3, 3, 4, 4, 4, 5]])
    assert document_positions(docs).tolist() == [[0, 1, 0, 1, 2, 0]]


def test_a_packed_block_scores_as_its_documents_alone(packed):
    s, tok = packed
    T = len(s) - 1  # one block holding every document (each ends in EOS)
    source = BlockSource(TokenSpan(s, 0, len(s)), T, shift=False, document_mask=True)
    batch = source.batch(Draw(np.zeros(1, np.int64), np.zeros(1, np.int64), np.zeros((1, 3), np.int64)))
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, d_model=16, max_seq_len=64, vocab_size=tok.vocab_size)).eval()
    with torch.no_grad():
        logits = model.logits(model(batch["input_ids"], doc_ids=batch["doc_ids"]))[0]  # (T, V)
        packed_sum = F.cross_entropy(logits, batch["targets"][0], ignore_index=IGNORE, reduction="sum")
        alone_sum = torch.zeros(())
        for start, end in zip([0, *s.doc_ends[:-1].tolist()], s.doc_ends.tolist()):
            ids = torch.from_numpy(np.asarray(s.tokens[start:end], dtype=np.int64))[None]  # one document with its EOS
            alone = model.logits(model(ids[:, :-1]))[0]
            alone_sum += F.cross_entropy(alone, ids[0, 1:], reduction="sum")
        unmasked = model.logits(model(batch["input_ids"]))[0]
        unmasked_sum = F.cross_entropy(unmasked, batch["targets"][0], ignore_index=IGNORE, reduction="sum")
    assert int((batch["targets"] == IGNORE).sum()) == len(DOCS) - 1  # the EOS -> next document targets
    assert torch.allclose(packed_sum, alone_sum, atol=1e-4, rtol=1e-6)
    assert not torch.allclose(unmasked_sum, alone_sum, atol=1e-2)  # without the mask the documents mix


def test_a_stream_tells_documents_apart_by_their_end_of_text_token(packed):
    """Streamed blocks carry no document offsets: the masks come from the EOS ids, and equal the store's."""
    s, tok = packed
    T = len(s) - 1
    from_store = BlockSource(TokenSpan(s, 0, len(s)), T, shift=False, document_mask=True).batch(
        Draw(np.zeros(1, np.int64), np.zeros(1, np.int64), np.zeros((1, 3), np.int64))
    )
    block = np.asarray(s.tokens[: T + 1], dtype=np.int64)[None]
    streamed = shifted_pairs(block, None, eos=tok.eos_id)
    assert set(streamed) == set(from_store)
    for key in from_store:
        assert torch.equal(streamed[key], from_store[key]), key
    assert documents_from_eos(np.array([[5, 0, 7, 0, 0, 9]]), eos=0).tolist() == [[0, 0, 1, 1, 2, 3]]


@pytest.mark.parametrize("streaming", [False, True], ids=["store", "stream"])
def test_pretraining_with_document_mask(tmp_path, small_text, write_recipe, streaming):
    raw = tiny_gpt_recipe(small_text, train={"steps": 4})
    raw["data"].update(document_mask=True, streaming=streaming, shuffle_buffer=8)
    path = write_recipe(raw)
    result = invoke("pretrain", "--recipe", path, "--out", tmp_path / "run", "--quiet")
    assert result.exit_code == 0, result.output
    assert [r["step"] for r in read_metrics(tmp_path / "run") if r.get("split") == "train"][-1] == 4
