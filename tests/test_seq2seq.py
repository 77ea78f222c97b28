"""Encoder-decoder generation and scoring: the cache changes nothing, scores match the full pass."""

from __future__ import annotations

import pytest
import torch

from tfcli.generate import generate_seq2seq
from tfcli.models.t5 import T5, T5Config
from tfcli.tasks.text_to_text import target_log_probs

V = 97


def tiny() -> T5:
    torch.manual_seed(0)
    return T5(T5Config(n_layer=2, n_head=4, d_model=32, d_ff=64, vocab_size=V, max_seq_len=40)).eval()


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=1.0, top_k=20, top_p=0.9, seed=3)])
def test_generation_with_cache_equals_generation_without(sampling):
    model = tiny()
    prompt = torch.randint(0, V, (1, 15))
    with_cache = list(generate_seq2seq(model, prompt, start_id=0, max_new_tokens=60, use_cache=True, **sampling))
    without = list(generate_seq2seq(model, prompt, start_id=0, max_new_tokens=60, use_cache=False, **sampling))
    assert len(with_cache) == 40  # stops at the decoder's max_seq_len
    assert with_cache == without


def test_greedy_generation_follows_the_argmax_of_the_full_pass_and_stops_at_eos():
    model = tiny()
    prompt = torch.randint(0, V, (1, 9))
    tokens = list(generate_seq2seq(model, prompt, start_id=0, max_new_tokens=8, temperature=0.0))
    with torch.no_grad():
        logits = model.logits(model(prompt, None, torch.tensor([[0] + tokens[:-1]])))
    assert logits.argmax(-1)[0].tolist() == tokens
    stopped = list(generate_seq2seq(model, prompt, start_id=0, max_new_tokens=8, temperature=0.0, eos_id=tokens[3]))
    assert stopped == tokens[: tokens.index(tokens[3])]


def test_target_log_probs_match_the_full_pass_and_ignore_padding():
    model = tiny()
    ids = torch.randint(1, V, (2, 11))
    targets = torch.randint(1, V, (2, 4))
    targets[1, 2:] = -100  # a shorter second target
    with torch.no_grad():
        scores = target_log_probs(model, model.encode(ids), None, targets, start_id=0)
        for row, n in ((0, 4), (1, 2)):
            t = targets[row : row + 1, :n]
            dec = torch.cat([torch.zeros(1, 1, dtype=torch.long), t[:, :-1]], dim=1)
            logp = model.logits(model(ids[row : row + 1], None, dec)).log_softmax(-1)
            expected = logp[0, torch.arange(n), t[0]].sum()
            assert torch.allclose(scores[row], expected, atol=1e-5)
