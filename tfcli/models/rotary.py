"""Rotary position embeddings (Su et al. 2021) and the frequency scalings Hugging Face configs carry.

`Rotary` is the positional part a model hands its attention: positions in, (cos, sin) out, once
per forward pass for every layer. The frequencies follow transformers' `modeling_rope_utils`
exactly, so that a Llama, Qwen or Mistral directory computes the same logits here:

  default   inv_freq = 1 / theta^(2i/d)
  linear    positions divided by `factor` (inv_freq / factor)
  dynamic   NTK-aware: theta grows once a sequence outruns the context the model was trained on
  llama3    Llama 3.1's smooth per-band interpolation (low_freq_factor, high_freq_factor)
  yarn      YaRN: interpolation blended with extrapolation per band, cos/sin scaled by mscale
  longrope  LongRoPE (Phi-3/4): a factor per frequency, the short set within the pretrained context and
            the long set past it, cos/sin scaled by sqrt(1 + ln(factor) / ln(pretrained context))
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


@dataclass(frozen=True)
class RopeScaling:
    """A model's rope: its base and frequency scaling (hf/positions.py reads it from a transformers config)."""

    theta: float = 10000.0
    type: str = "default"
    factor: float = 1.0
    original_max: int = 0  # the context the model was pretrained on (0: max_position_embeddings)
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float = 0.0  # yarn: cos/sin scale (0: from factor)
    truncate: bool = True  # yarn
    short_factor: tuple[float, ...] = ()  # longrope: within the pretrained context, one per frequency
    long_factor: tuple[float, ...] = ()  # longrope: past it


def check_rope(scaling: RopeScaling) -> None:
    if scaling.type not in ROPE_TYPES:
        raise ValueError(f"model.rope_type {scaling.type!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
    if scaling.theta <= 0 or scaling.factor <= 0:
        raise ValueError("model.rope_theta and model.rope_factor must be > 0")
    if scaling.type == "longrope" and not (scaling.short_factor and scaling.long_factor and scaling.original_max):
        raise ValueError("longrope needs short_factor, long_factor and original_max_position_embeddings")


def base_frequencies(dim: int, theta: float) -> Tensor:
    """(dim/2,) 1 / theta^(2i/dim), as transformers computes them (int64 arange, then float)."""
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def frequencies(dim: int, s: RopeScaling, context: int, seq_len: int = 0) -> tuple[Tensor, float]:
    """(dim/2,) inverse frequencies and the cos/sin scale for a rope type. `context` is the model's
    max_position_embeddings; `seq_len` the longest position + 1 seen now (dynamic only)."""
    if s.type == "linear":
        return base_frequencies(dim, s.theta) / s.factor, 1.0
    if s.type == "dynamic":
        trained = s.original_max or context
        length = max(seq_len, trained)
        theta = s.theta * ((s.factor * length / trained) - (s.factor - 1)) ** (dim / (dim - 2))
        return base_frequencies(dim, theta), 1.0
    if s.type == "llama3":
        return _llama3(base_frequencies(dim, s.theta), s, s.original_max or context), 1.0
    if s.type == "yarn":
        return _yarn(dim, s, s.original_max or context)
    if s.type == "longrope":
        return _longrope(dim, s, seq_len)
    return base_frequencies(dim, s.theta), 1.0


def _longrope(dim: int, s: RopeScaling, seq_len: int) -> tuple[Tensor, float]:
    """LongRoPE: base frequencies each divided by its own factor, the long set once a sequence
    outruns the pretrained context (s.original_max), the short set before."""
    factors = s.long_factor if seq_len > s.original_max else s.short_factor
    if len(factors) != dim // 2:
        raise ValueError(f"longrope has {len(factors)} factors for {dim // 2} rotary frequencies")
    scale = s.attention_factor or (
        math.sqrt(1 + math.log(s.factor) / math.log(s.original_max)) if s.factor > 1 else 1.0
    )
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (torch.tensor(factors, dtype=torch.float32) * s.theta**shape), scale


def _llama3(inv_freq: Tensor, s: RopeScaling, old_context: int) -> Tensor:
    """Long wavelengths divided by factor, short ones kept, the band between interpolated smoothly."""
    low_wavelen, high_wavelen = old_context / s.low_freq_factor, old_context / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_context / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(dim: int, s: RopeScaling, old_context: int) -> tuple[Tensor, float]:
    """YaRN (Peng et al. 2023): per band, interpolation (inv_freq / factor) or extrapolation (kept),
    ramped between the bands of beta_fast and beta_slow rotations; cos/sin scaled by
    0.1 ln(factor) + 1 unless the config names the scale."""
    scale = s.attention_factor or (0.1 * math.log(s.factor) + 1.0 if s.factor > 1 else 1.0)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_context / (rotations * 2 * math.pi)) / (2 * math.log(s.theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolated = base_frequencies(dim, s.theta)
    keep = 1 - ramp  # 1 where the band is extrapolated (high frequencies)
    return extrapolated / s.factor * (1 - keep) + extrapolated * keep, scale


class Rotary(nn.Module):
    """Positions (B or 1, T) -> (cos, sin) each (B or 1, T, head_dim), in fp32; no parameters."""

    def __init__(self, head_dim: int, scaling: RopeScaling, context: int):
        super().__init__()
        check_rope(scaling)
        self.head_dim, self.scaling, self.context = head_dim, scaling, context
        inv_freq, self.attention_scale = frequencies(head_dim, scaling, context)
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # (hs/2,)

    def forward(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        inv_freq = self.inv_freq
        if self.scaling.type in ("dynamic", "longrope"):
            longest = int(positions.max()) + 1
            if longest > (self.scaling.original_max or self.context):
                inv_freq = frequencies(self.head_dim, self.scaling, self.context, longest)[0].to(inv_freq.device)
        angles = positions[..., None].float() * inv_freq  # (B, T, hs/2)
        emb = torch.cat((angles, angles), dim=-1)  # (B, T, hs)
        return emb.cos() * self.attention_scale, emb.sin() * self.attention_scale
