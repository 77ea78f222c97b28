"""The encoder-decoder: parity with transformers' T5ForConditionalGeneration, the KV cache,
causality of the decoder, padding, and the published T5-small size."""
from __future__ import annotations

import pytest
import torch

from tfcli import recipe as recipes
from tfcli.hf.t5 import config_to_hf, export_model, load_pretrained, state_dict_from_hf, state_dict_to_hf
from tfcli.models import build_model
from tfcli.models.t5 import T5, T5Config

V = 101


def tiny(**kw) -> T5:
    torch.manual_seed(0)
    cfg = {"n_layer": 2, "n_decoder_layer": 3, "n_head": 4, "d_model": 32, "d_kv": 8, "d_ff": 64,
           "vocab_size": V, "max_seq_len": 64, "relative_attention_num_buckets": 8,
           "relative_attention_max_distance": 20, **kw}
    return T5(T5Config(**cfg)).eval()


def hf_twin(model: T5):
    """transformers' T5ForConditionalGeneration carrying the same weights."""
    from transformers import T5Config as HFConfig, T5ForConditionalGeneration

    hf = T5ForConditionalGeneration(HFConfig(**config_to_hf(model.cfg))).eval()
    sd = state_dict_to_hf(model.state_dict(), model.cfg)
    if not model.cfg.tie_word_embeddings:  # transformers 5 always ties lm_head to shared
        assert torch.equal(sd["lm_head.weight"], sd["shared.weight"])
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    assert not unexpected and not [m for m in missing if "embed_tokens" not in m and m != "lm_head.weight"]
    return hf


@pytest.mark.parametrize("kw", [{}, {"feed_forward": "relu"}, {"tie_word_embeddings": False}])
def test_logits_match_transformers(kw):
    model = tiny(**kw)
    if not model.cfg.tie_word_embeddings:
        model.lm_head.weight.data.copy_(model.shared.weight)  # see hf_twin
    hf = hf_twin(model)
    torch.manual_seed(1)
    ids = torch.randint(0, V, (3, 30))  # longer than max_distance: the log-spaced buckets are used
    mask = torch.ones(3, 30, dtype=torch.long)
    mask[1, 22:] = 0  # one padded row
    dec = torch.randint(0, V, (3, 25))
    with torch.no_grad():
        ours = model.logits(model(ids, mask, dec))
        theirs = hf(input_ids=ids, attention_mask=mask, decoder_input_ids=dec).logits
    assert (ours - theirs).abs().max() < 1e-4


def test_state_dict_round_trip_and_load_pretrained(tmp_path):
    model = tiny(tie_word_embeddings=False)
    sd = model.state_dict()
    back = state_dict_from_hf(state_dict_to_hf(sd, model.cfg), model.cfg)
    assert sd.keys() == back.keys() and all(torch.equal(sd[k], back[k]) for k in sd)
    tied = tiny()
    loaded = load_pretrained(export_model(tied, tmp_path / "hf"))
    for k, v in tied.state_dict().items():
        assert torch.equal(v, loaded.state_dict()[k]), k


def test_export_loads_in_transformers(tmp_path):
    from transformers import T5ForConditionalGeneration

    model = tiny()
    hf = T5ForConditionalGeneration.from_pretrained(export_model(model, tmp_path / "hf")).eval()
    ids, dec = torch.randint(0, V, (2, 12)), torch.randint(0, V, (2, 7))
    with torch.no_grad():
        diff = model.logits(model(ids, None, dec)) - hf(input_ids=ids, decoder_input_ids=dec).logits
    assert diff.abs().max() < 1e-4


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
        steps += [model.decode(dec[:, t: t + 1], enc, mask, caches) for t in range(5, 12)]
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
