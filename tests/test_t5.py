"""The encoder-decoder: the KV cache, causality of the decoder, padding, and the published T5-small
size (parity with transformers: test_hf)."""

from __future__ import annotations

import torch

from tfcli import recipe as recipes
from tfcli.models import build_model
from tfcli.models.t5 import T5, T5Config

V = 101


def tiny(**kw) -> T5:
    torch.manual_seed(0)
    cfg = {
        "n_layer": 2,
        "n_decoder_layer": 3,
        "n_head": 4,
        "d_model": 32,
        "d_kv": 8,
        "d_ff": 64,
        "vocab_size": V,
        "max_seq_len": 64,
        "relative_attention_num_buckets": 8,
        "relative_attention_max_distance": 20,
        **kw,
    }
    return T5(T5Config(**cfg)).eval()


def test_cached_decoding_matches_full_decoding():
    model = tiny()
    ids = torch.randint(0, V, (2, 20))
    mask = torch.ones(2, 20, dtype=torch.long)
    mask[0, 15:] = 0
    dec = torch.randint(0, V, (2, 12))
    with torch.no_grad():
        enc = model.encode(ids, mask)
        full = model.decode(dec, enc, mask)
        caches = model.new_caches(16)
        steps = [model.decode(dec[:, :5], enc, mask, caches)]  # a prefix, then one token at a time
        steps += [model.decode(dec[:, t : t + 1], enc, mask, caches) for t in range(5, 12)]
    assert torch.allclose(full, torch.cat(steps, dim=1), atol=1e-5)


def test_decoder_is_causal_and_encoder_ignores_padding():
    model = tiny()
    ids = torch.randint(0, V, (1, 16))
    dec = torch.randint(0, V, (1, 10))
    changed = dec.clone()
    changed[:, 6:] = (changed[:, 6:] + 1) % V
    with torch.no_grad():
        a, b = model(ids, None, dec), model(ids, None, changed)
        assert torch.equal(a[:, :6], b[:, :6]) and not torch.allclose(a[:, 6:], b[:, 6:])
        padded = torch.cat([ids, torch.randint(0, V, (1, 5))], dim=1)
        mask = torch.cat([torch.ones(1, 16), torch.zeros(1, 5)], dim=1).long()
        assert torch.allclose(model(ids, None, dec), model(padded, mask, dec), atol=1e-5)


def test_t5_small_recipe_has_the_published_size():
    recipe = recipes.load("t5-small", {"model.vocab_size": 32128})
    model = build_model(recipe.model)
    n = sum(p.numel() for p in model.parameters())
    assert abs(n - 60e6) / 60e6 < 0.02, n
