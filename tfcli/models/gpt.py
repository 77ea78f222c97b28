"""GPT-2-shaped decoder: learned positions, pre-norm causal blocks, LM head tied to the embedding."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor, nn

from .blocks import Attention, Block, KVCache, MLP, check_config, init_normal_, make_norm, scale_residual_projections_


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a GPT. vocab_size 0 means 'take it from the tokenizer'."""

    family: str = "gpt"
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 256
    d_ff: int = 0  # 0 -> 4 * d_model
    max_seq_len: int = 256
    vocab_size: int = 0
    dropout: float = 0.0
    bias: bool = True
    layer_norm_eps: float = 1e-5

    def __post_init__(self):
        check_config(self)
        if self.d_model % self.n_head:
            raise ValueError(f"model.d_model ({self.d_model}) must be divisible by model.n_head ({self.n_head})")
        if not self.d_ff:
            object.__setattr__(self, "d_ff", 4 * self.d_model)


class GPT(nn.Module):
    """Decoder-only transformer. forward() returns hidden states; logits() applies the tied head."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        if cfg.vocab_size <= 0:
            raise ValueError("model.vocab_size must be set (it is filled in from the tokenizer)")
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.max_seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(
            Block(
                Attention(cfg.d_model, cfg.n_head, bias=cfg.bias, dropout=cfg.dropout),
                MLP(cfg.d_model, cfg.d_ff, activation="gelu_tanh", bias=cfg.bias, dropout=cfg.dropout),
                make_norm("layernorm", cfg.d_model, cfg.layer_norm_eps, cfg.bias),
                make_norm("layernorm", cfg.d_model, cfg.layer_norm_eps, cfg.bias),
                prenorm=True,
                dropout=cfg.dropout,
            )
            for _ in range(cfg.n_layer)
        )
        self.ln_f = make_norm("layernorm", cfg.d_model, cfg.layer_norm_eps, cfg.bias)
        init_normal_(self)
        scale_residual_projections_(self.blocks, cfg.n_layer)

    @property
    def lm_head_weight(self) -> Tensor:
        return self.wte.weight  # tied, as in GPT-2

    def new_caches(self, max_len: Optional[int] = None) -> list[KVCache]:
        return [KVCache(max_len or self.cfg.max_seq_len) for _ in self.blocks]

    def forward(self, input_ids: Tensor, caches: Optional[list[KVCache]] = None, all_layers: bool = False,
                doc_ids: Optional[Tensor] = None, key_mask: Optional[Tensor] = None):
        """input_ids (B, T) -> hidden states (B, T, D). With caches, T new tokens follow the cached ones.
        all_layers: every block's output, each through the final norm (features for a classifier).
        doc_ids (B, T): packed documents; a token attends within its own document only and its
        position counts from its document's first token in the block.
        key_mask (B, cached + T) of 1 = token, 0 = left padding (batched generation): pads are never
        attended to and positions count real tokens only."""
        B, T = input_ids.shape
        start = caches[0].length if caches else 0
        if start + T > self.cfg.max_seq_len:
            raise ValueError(f"sequence of {start + T} tokens is longer than the context ({self.cfg.max_seq_len})")
        mask = None
        if key_mask is not None:
            pos = (key_mask.cumsum(1) - 1).clamp(min=0)[:, start:]  # (B, T): each row's own positions
            mask = key_mask.bool()[:, None, None, :] | own_key(T, start + T, input_ids.device)  # (B, 1, T, Tk)
        elif doc_ids is None:
            pos = torch.arange(start, start + T, device=input_ids.device)
        else:
            pos, mask = document_positions(doc_ids), (doc_ids[:, :, None] == doc_ids[:, None, :])[:, None]  # (B, 1, T, T)
        x = self.drop(self.wte(input_ids) + self.wpe(pos))  # (B, T, D)
        layers = []
        for i, block in enumerate(self.blocks):
            x = block(x, mask=mask, causal=True, cache=caches[i] if caches else None)
            layers.append(x)
        return [self.ln_f(h) for h in layers] if all_layers else self.ln_f(x)

    def logits(self, hidden: Tensor) -> Tensor:
        """(B, T, D) -> (B, T, vocab)."""
        return hidden @ self.lm_head_weight.t()


def own_key(t_query: int, t_key: int, device) -> Tensor:
    """(Tq, Tk) True where a query meets its own key: a left pad then sees itself, so no row of its
    attention is all masked (that would give NaN, which the next layer's keys would carry on)."""
    shift = t_key - t_query  # the queries are the last Tq of the Tk positions
    return torch.ones(t_query, t_key, dtype=torch.bool, device=device).tril(shift).triu(shift)


def document_positions(doc_ids: Tensor) -> Tensor:
    """(B, T) document numbers -> (B, T) positions counted from each document's first token."""
    T = doc_ids.size(1)
    idx = torch.arange(T, device=doc_ids.device).expand_as(doc_ids)
    first = torch.ones_like(doc_ids, dtype=torch.bool)
    first[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    starts = torch.cummax(torch.where(first, idx, torch.zeros_like(idx)), dim=1).values
    return idx - starts
