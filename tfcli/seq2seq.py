"""Encoder-decoder inference: encode once, then decode from the start token with a KV cache
(sampling as for decoders, `generate.sample_next`), or score given candidate targets."""
from __future__ import annotations

from typing import Iterator, Optional

import torch
from torch import Tensor, nn

from .generate import sampling_loop


@torch.no_grad()
def generate_seq2seq(model: nn.Module, input_ids: Tensor, *, start_id: int, max_new_tokens: int,
                     attention_mask: Optional[Tensor] = None, temperature: float = 1.0, top_k: int = 0,
                     top_p: float = 1.0, eos_id: Optional[int] = None, use_cache: bool = True,
                     seed: Optional[int] = None) -> Iterator[int]:
    """Yield new target ids for input_ids (1, S). The decoder starts from `start_id` (T5: pad) and
    may produce at most model.cfg.max_seq_len tokens; without the cache every step re-decodes all."""
    encoded = model.encode(input_ids, attention_mask)  # (1, S, D), computed once
    steps = min(max_new_tokens, model.cfg.max_seq_len)
    caches = model.new_caches(steps) if use_cache else None
    dec = torch.full((input_ids.size(0), 1), start_id, dtype=torch.long, device=input_ids.device)

    def next_logits(previous: Optional[Tensor]) -> Tensor:
        nonlocal dec
        if previous is not None:
            dec = torch.cat([dec, previous], dim=1)
        if caches is not None:  # only the newest token goes in; the cache holds the rest
            hidden = model.decode(dec[:, -1:] if previous is not None else dec, encoded, attention_mask, caches)
        else:
            hidden = model.decode(dec, encoded, attention_mask)  # (1, t, D): re-decode everything
        return model.logits(hidden[:, -1])

    return sampling_loop(next_logits, max_new_tokens=steps, temperature=temperature, top_k=top_k, top_p=top_p,
                         eos_id=eos_id, seed=seed, device=input_ids.device)


def target_log_probs(model: nn.Module, encoded: Tensor, encoder_mask: Optional[Tensor], targets: Tensor,
                     start_id: int, ignore_id: int = -100) -> Tensor:
    """Sum of log p(target token) over each row's target: targets (B, T) with ignore_id padding -> (B,).
    Teacher-forced: the decoder input is the target shifted right behind the start token."""
    dec = targets.new_full(targets.shape, start_id)
    dec[:, 1:] = targets[:, :-1]
    dec = dec.masked_fill(dec == ignore_id, start_id)
    logp = model.logits(model.decode(dec, encoded, encoder_mask)).float().log_softmax(-1)  # (B, T, V)
    picked = logp.gather(-1, targets.clamp(min=0)[..., None]).squeeze(-1)  # (B, T)
    return (picked * (targets != ignore_id)).sum(-1)
