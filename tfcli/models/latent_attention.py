"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2): keys and values come from one compressed
latent per token, so that generation caches the latent, not every head's keys and values.

Each token's hidden state is projected down to a latent of `kv_rank` (RMS-normed) and one shared
rotary key of `rope_dim`; the latent is projected up to every head's un-rotated key part and value.
Queries come straight from the hidden state, or through their own low-rank bottleneck (`q_rank`,
RMS-normed). A head's query and key are [un-rotated part, rotary part]; the rotary key is the same
for every head. The KV cache holds (latent, rotated key): kv_rank + rope_dim numbers a token, where
grouped-query attention holds 2 x n_kv_head x head_dim (DeepSeek-V3: 576 against 32,768 for its 128
heads of 128 + 128). DeepSeek's checkpoints interleave the rotary dimensions in pairs (`interleaved`):
they are gathered into halves before turning, which is the same rotation.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .blocks import Attention, KVCache, Linear, make_norm
from .fused import rotate

LATENT_NORM_EPS = 1e-6  # DeepSeek's q/kv latent norms keep their module default, not rms_norm_eps


class LatentAttention(Attention):
    """Self-attention from a compressed latent; forward as Attention's (masks, a causal window of
    none, SDPA), with its own projections."""

    def __init__(
        self,
        d_model: int,
        n_head: int,
        *,
        nope_dim: int,
        rope_dim: int,
        v_dim: int,
        kv_rank: int,
        q_rank: int = 0,
        bias: bool = False,
        dropout: float = 0.0,
        scale: float | None = None,
        interleaved: bool = False,
    ):
        nn.Module.__init__(self)
        self.n_head = self.n_kv_head = n_head
        self.nope_dim, self.rope_dim, self.v_dim, self.kv_rank = nope_dim, rope_dim, v_dim, kv_rank
        self.head_dim = nope_dim + rope_dim  # a query's and a key's width
        self.inner = n_head * v_dim  # the attention's output width (the values')
        self.cross, self.scale, self.dropout, self.window, self.softcap = False, scale, dropout, 0, 0.0
        self.sinks, self.q_norm, self.k_norm, self.interleaved = None, None, None, interleaved
        if q_rank:
            self.q_a = Linear(d_model, q_rank, bias=bias)
            self.q_a_norm = make_norm("rmsnorm", q_rank, LATENT_NORM_EPS)
            self.q_b = Linear(q_rank, n_head * self.head_dim, bias=False)
        else:
            self.q = Linear(d_model, n_head * self.head_dim, bias=False)
        self.kv_a = Linear(d_model, kv_rank + rope_dim, bias=bias)
        self.kv_norm = make_norm("rmsnorm", kv_rank, LATENT_NORM_EPS)
        self.kv_b = Linear(kv_rank, n_head * (nope_dim + v_dim), bias=False)
        self.out = Linear(self.inner, d_model, bias=bias)

    def layout(self, leaf: str) -> tuple[tuple[str, int], ...]:
        """Each projection is one part, named as adapter.targets names it (q, q_a, q_b, kv_a, kv_b, o)."""
        return (("o" if leaf == "out" else leaf, getattr(self, leaf).out_features),)

    def _project(
        self, x: Tensor, context: Tensor | None, cache: KVCache | None, rope: tuple[Tensor, Tensor] | None
    ) -> tuple[Tensor, Tensor, Tensor]:
        B, T, _ = x.shape
        q = self.q_b(self.q_a_norm(self.q_a(x))) if hasattr(self, "q_a") else self.q(x)
        q_pass, q_rot = self._heads(q, self.n_head).split((self.nope_dim, self.rope_dim), dim=-1)
        latent, k_rot = self.kv_a(x).split((self.kv_rank, self.rope_dim), dim=-1)
        latent, k_rot = self.kv_norm(latent)[:, None], k_rot[:, None]  # (B, 1, T, r) and (B, 1, T, rope)
        if rope is not None:
            q_rot, k_rot = rotate(self._halves(q_rot), *rope), rotate(self._halves(k_rot), *rope)
        if cache is not None:  # the compressed cache: the latent and the rotated key
            latent, k_rot = cache.append(latent, k_rot)
        t_key = latent.size(2)
        kv = self.kv_b(latent[:, 0]).view(B, t_key, self.n_head, self.nope_dim + self.v_dim).transpose(1, 2)
        k_pass, v = kv.split((self.nope_dim, self.v_dim), dim=-1)
        k = torch.cat((k_pass, k_rot.expand(-1, self.n_head, -1, -1)), dim=-1)
        return torch.cat((q_pass, q_rot), dim=-1), k, v.contiguous()

    def _heads(self, x: Tensor, n: int) -> Tensor:
        B, T, _ = x.shape  # (B, T, n * hs) -> (B, n, T, hs)
        return x.view(B, T, n, -1).transpose(1, 2)

    def _halves(self, x: Tensor) -> Tensor:
        """Interleaved rotary pairs (x0, x1), (x2, x3), ... -> halves (x0, x2, ...), (x1, x3, ...)."""
        return x.unflatten(-1, (-1, 2)).transpose(-2, -1).flatten(-2) if self.interleaved else x
