"""The transformer parts every family shares: attention, MLP, norms, the residual block.

This is the only attention code in tfcli. BERT, GPT, T5 and ViT differ only in how their
builders wire these parts (pre- or post-norm, LayerNorm or RMSNorm, biases, activation,
what goes into the attention mask), never in the parts themselves.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import Tensor, nn


POSITIVE = ("n_layer", "n_head", "d_model", "max_seq_len", "image_size", "patch_size", "channels", "decoder_d_model",
            "decoder_n_layer", "decoder_n_head", "type_vocab_size", "relative_attention_max_distance")
NON_NEGATIVE = ("d_ff", "vocab_size", "n_decoder_layer", "d_kv", "decoder_d_ff")


def check_config(cfg) -> None:
    """The ranges every family's config shares (sizes >= 1, dropout in [0, 1), eps > 0), named by
    their recipe path; each config's __post_init__ calls this before its own checks."""
    for name in POSITIVE:
        if hasattr(cfg, name) and getattr(cfg, name) < 1:
            raise ValueError(f"model.{name} must be >= 1, got {getattr(cfg, name)!r}")
    for name in NON_NEGATIVE:
        if hasattr(cfg, name) and getattr(cfg, name) < 0:
            raise ValueError(f"model.{name} must be >= 0, got {getattr(cfg, name)!r}")
    if not 0 <= cfg.dropout < 1:
        raise ValueError(f"model.dropout must be in [0, 1), got {cfg.dropout!r}")
    if not cfg.layer_norm_eps > 0:
        raise ValueError(f"model.layer_norm_eps must be > 0, got {cfg.layer_norm_eps!r}")


class KVCache:
    """Keys and values of one attention layer, kept across decoding steps.

    Preallocated to `max_len` so that each new token costs one position of compute and
    no re-concatenation. For cross-attention it simply holds the projected encoder output.
    """

    def __init__(self, max_len: int):
        self.max_len = max_len
        self.k: Optional[Tensor] = None  # (B, nh, max_len, hs)
        self.v: Optional[Tensor] = None
        self.length = 0

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store k, v of shape (B, nh, T, hs) after the cached ones; return all so far."""
        B, nh, T, hs = k.shape
        if self.k is None:
            self.k = k.new_empty(B, nh, self.max_len, hs)
            self.v = v.new_empty(B, nh, self.max_len, hs)
        if self.length + T > self.max_len:
            raise ValueError(f"KV cache full: {self.length} + {T} > {self.max_len} positions")
        self.k[:, :, self.length : self.length + T] = k
        self.v[:, :, self.length : self.length + T] = v
        self.length += T
        return self.k[:, :, : self.length], self.v[:, :, : self.length]


def padding_mask(attention_mask: Tensor) -> Tensor:
    """(B, Tk) of 1 = token, 0 = pad  ->  boolean (B, 1, 1, Tk), True where a key may be seen."""
    return attention_mask.bool()[:, None, None, :]


def causal_mask(t_query: int, t_key: int, device=None) -> Tensor:
    """Boolean (Tq, Tk): query i (the last Tq of Tk positions) sees keys j <= its own position."""
    return torch.ones(t_query, t_key, dtype=torch.bool, device=device).tril(diagonal=t_key - t_query)


class Attention(nn.Module):
    """Multi-head scaled dot-product attention, self or cross, through one fused SDPA call.

    `mask` is boolean (True = may attend) or additive float (T5's position bias), broadcastable
    to (B, nh, Tq, Tk). `causal` masks future keys. `scale=None` is 1/sqrt(head_dim).
    """

    def __init__(
        self,
        d_model: int,
        n_head: int,
        *,
        head_dim: Optional[int] = None,
        bias: bool = True,
        dropout: float = 0.0,
        cross: bool = False,
        scale: Optional[float] = None,
    ):
        super().__init__()
        self.n_head = n_head
        self.head_dim = head_dim or d_model // n_head
        self.inner = n_head * self.head_dim
        self.cross = cross
        self.scale = scale
        self.dropout = dropout
        if cross:
            self.q = nn.Linear(d_model, self.inner, bias=bias)
            self.kv = nn.Linear(d_model, 2 * self.inner, bias=bias)
        else:
            self.qkv = nn.Linear(d_model, 3 * self.inner, bias=bias)
        self.out = nn.Linear(self.inner, d_model, bias=bias)

    def _heads(self, x: Tensor) -> Tensor:
        B, T, _ = x.shape  # (B, T, nh*hs) -> (B, nh, T, hs)
        return x.view(B, T, self.n_head, self.head_dim).transpose(1, 2)

    def forward(
        self,
        x: Tensor,
        *,
        context: Optional[Tensor] = None,
        mask: Optional[Tensor] = None,
        causal: bool = False,
        cache: Optional[KVCache] = None,
    ) -> Tensor:
        B, T, _ = x.shape
        if self.cross:
            q = self._heads(self.q(x))
            if cache is not None and cache.k is not None:
                k, v = cache.k, cache.v  # encoder output projected once, reused every step
            else:
                k, v = (self._heads(t) for t in self.kv(context).split(self.inner, dim=-1))
                if cache is not None:
                    cache.k, cache.v, cache.length = k, v, k.size(2)
        else:
            q, k, v = (self._heads(t) for t in self.qkv(x).split(self.inner, dim=-1))
            if cache is not None:
                k, v = cache.append(k, v)
        t_key = k.size(2)
        is_causal = False
        if causal:
            if mask is None and t_key == T:
                is_causal = True  # fast path: SDPA builds the triangle itself
            elif T > 1:
                tri = causal_mask(T, t_key, x.device)
                mask = tri if mask is None else _combine(mask, tri)
        y = F.scaled_dot_product_attention(
            q, k, v,
            attn_mask=mask,
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=is_causal,
            scale=self.scale,
        )  # (B, nh, T, hs)
        return self.out(y.transpose(1, 2).reshape(B, T, self.inner))


def _combine(mask: Tensor, allowed: Tensor) -> Tensor:
    """Merge a boolean or additive mask with a boolean `allowed` pattern."""
    if mask.dtype == torch.bool:
        return mask & allowed
    return mask.masked_fill(~allowed, float("-inf"))


ACTIVATIONS = {
    "gelu": lambda x: F.gelu(x),
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),  # GPT-2's "gelu_new"
    "relu": F.relu,
    "silu": F.silu,
}


class MLP(nn.Module):
    """Position-wise feed-forward: up, activation (optionally gated as in T5 v1.1), down."""

    def __init__(self, d_model: int, d_ff: int, *, activation: str = "gelu", bias: bool = True,
                 gated: bool = False, dropout: float = 0.0):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r}; choose from {sorted(ACTIVATIONS)}")
        self.act = ACTIVATIONS[activation]
        self.up = nn.Linear(d_model, d_ff, bias=bias)
        self.gate = nn.Linear(d_model, d_ff, bias=bias) if gated else None
        self.down = nn.Linear(d_ff, d_model, bias=bias)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        h = self.act(self.gate(x)) * self.up(x) if self.gate is not None else self.act(self.up(x))
        return self.down(self.drop(h))


def make_norm(kind: str, d: int, eps: float, bias: bool = True) -> nn.Module:
    """'layernorm' (BERT, GPT, ViT) or 'rmsnorm' (T5: no centring, no bias)."""
    if kind == "layernorm":
        return nn.LayerNorm(d, eps=eps, bias=bias)
    if kind == "rmsnorm":
        return nn.RMSNorm(d, eps=eps)
    raise ValueError(f"unknown norm {kind!r}; choose 'layernorm' or 'rmsnorm'")


class Block(nn.Module):
    """Residual block: self-attention, optional cross-attention, MLP.

    prenorm=True (GPT, T5, ViT): x + f(norm(x)). prenorm=False (BERT): norm(x + f(x)).
    """

    def __init__(self, attn: Attention, mlp: MLP, norm_attn: nn.Module, norm_mlp: nn.Module, *,
                 cross_attn: Optional[Attention] = None, norm_cross: Optional[nn.Module] = None,
                 prenorm: bool = True, dropout: float = 0.0):
        super().__init__()
        self.attn, self.mlp = attn, mlp
        self.norm_attn, self.norm_mlp = norm_attn, norm_mlp
        self.cross_attn, self.norm_cross = cross_attn, norm_cross
        self.prenorm = prenorm
        self.drop = nn.Dropout(dropout)
        self.checkpointing = False  # recompute activations in the backward pass (train.activation_checkpointing)

    def _residual(self, x: Tensor, norm: nn.Module, f) -> Tensor:
        if self.prenorm:
            return x + self.drop(f(norm(x)))
        return norm(x + self.drop(f(x)))

    def forward(self, x: Tensor, *, mask: Optional[Tensor] = None, causal: bool = False,
                cache: Optional[KVCache] = None, context: Optional[Tensor] = None,
                context_mask: Optional[Tensor] = None, cross_cache: Optional[KVCache] = None) -> Tensor:
        kwargs = dict(mask=mask, causal=causal, cache=cache, context=context, context_mask=context_mask,
                      cross_cache=cross_cache)
        if self.checkpointing and self.training and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(self._forward, x, use_reentrant=False, **kwargs)
        return self._forward(x, **kwargs)

    def _forward(self, x: Tensor, *, mask: Optional[Tensor], causal: bool, cache: Optional[KVCache],
                 context: Optional[Tensor], context_mask: Optional[Tensor], cross_cache: Optional[KVCache]) -> Tensor:
        x = self._residual(x, self.norm_attn, lambda h: self.attn(h, mask=mask, causal=causal, cache=cache))
        if self.cross_attn is not None:
            x = self._residual(x, self.norm_cross, lambda h: self.cross_attn(
                h, context=context, mask=context_mask, cache=cross_cache))
        return self._residual(x, self.norm_mlp, self.mlp)


def init_normal_(module: nn.Module, std: float = 0.02) -> None:
    """GPT-2/BERT initialisation: N(0, std) weights, zero biases, unit norms."""
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=std)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, (nn.LayerNorm, nn.RMSNorm)):
            if m.weight is not None:
                nn.init.ones_(m.weight)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)


def scale_residual_projections_(blocks: nn.ModuleList, n_layer: int, std: float = 0.02) -> None:
    """GPT-2: residual output projections get std / sqrt(2 * n_layer)."""
    for block in blocks:
        for proj in (block.attn.out, block.mlp.down):
            nn.init.normal_(proj.weight, mean=0.0, std=std / math.sqrt(2 * n_layer))
