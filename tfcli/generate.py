"""Autoregressive generation: greedy, temperature, top-k, top-p, with a key/value cache."""
from __future__ import annotations

from typing import Callable, Iterator, Optional

import torch
from torch import Tensor, nn


def sample_next(logits: Tensor, *, temperature: float, top_k: int, top_p: float,
                generator: Optional[torch.Generator]) -> Tensor:
    """(B, V) logits of the last position -> (B,) next ids. temperature 0 means greedy."""
    if temperature <= 0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if 0 < top_p < 1:
        sorted_logits, order = logits.sort(-1, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop = cumulative - sorted_logits.softmax(-1) > top_p  # keep the smallest set reaching top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def sampling_loop(next_logits: Callable[[Optional[Tensor]], Tensor], *, max_new_tokens: int,
                  temperature: float, top_k: int, top_p: float, eos_id: Optional[int],
                  seed: Optional[int], device: torch.device) -> Iterator[int]:
    """Sample up to max_new_tokens ids, stopping at EOS, for any autoregressive model.

    next_logits(previous) gets the id just sampled, (B, 1), or None before the first step, and
    returns the (B, V) logits of the next position: the model-specific part (cache, windows)."""
    generator = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
    previous = None
    for _ in range(max_new_tokens):
        nxt = sample_next(next_logits(previous), temperature=temperature, top_k=top_k, top_p=top_p,
                          generator=generator)
        token = int(nxt[0])
        if eos_id is not None and token == eos_id:
            return
        yield token
        previous = nxt[:, None]


@torch.no_grad()
def generate_tokens(model: nn.Module, prompt: Tensor, *, max_new_tokens: int, temperature: float = 1.0,
                    top_k: int = 0, top_p: float = 1.0, eos_id: Optional[int] = None, use_cache: bool = True,
                    seed: Optional[int] = None) -> Iterator[int]:
    """Yield new token ids for a decoder (`model(ids, caches) -> hidden`, `model.logits(hidden)`).

    prompt (1, T). The model sees at most its context of the latest tokens; once a sequence
    outgrows it, learned positions shift and each step recomputes the window (cache or not).
    """
    ctx = model.cfg.max_seq_len
    ids = prompt[:, -ctx:]
    caches = model.new_caches(ctx) if use_cache else None

    def next_logits(previous: Optional[Tensor]) -> Tensor:
        nonlocal ids, caches
        pending = ids if previous is None else previous  # tokens the cache has not seen
        if previous is not None:
            ids = torch.cat([ids, previous], dim=1)
        if caches is not None and caches[0].length + pending.size(1) <= ctx:
            hidden = model(pending, caches)
        else:
            caches = None  # the window slides: positions change, the cache no longer applies
            hidden = model(ids[:, -ctx:])
        return model.logits(hidden[:, -1])

    return sampling_loop(next_logits, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                         top_p=top_p, eos_id=eos_id, seed=seed, device=prompt.device)


class TextStreamer:
    """Turns a growing list of ids into newly printable text (never splits a multi-byte character)."""

    def __init__(self, decode):
        self.decode, self.ids, self.printed = decode, [], 0

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""  # wait for the rest of the character
        new, self.printed = text[self.printed:], len(text)
        return new
