"""ModernBERT-shaped encoder (Warner et al. 2024): token embeddings normalised (no learned positions),
pre-norm blocks (the first without a norm before attention), rotary positions, GeGLU, no biases by
default, local attention (each token sees the `local_window` // 2 tokens on either side) in all but
every `global_every`-th layer, which sees everything, each kind with its own rotary base; a final
norm, and a prediction head (dense, GELU, norm) that its classifiers read. Built from the shared parts.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

import torch
from torch import Tensor, nn

from .blocks import (
    ACTIVATIONS,
    MLP,
    Attention,
    Block,
    check_config,
    dense_flops_per_token,
    init_normal_,
    padding_mask,
    through_blocks,
)
from .pooling import TextEncoderTraits
from .rotary import RopeScaling, Rotary


@dataclass(frozen=True)
class ModernBertConfig:
    """Shape of a ModernBERT. vocab_size 0 means 'take it from the tokenizer'."""

    family: str = "modernbert"
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 256
    d_ff: int = 0  # 0 -> 1.5 * d_model (the GeGLU's inner width)
    max_seq_len: int = 512  # max_position_embeddings
    vocab_size: int = 0
    dropout: float = 0.0
    layer_norm_eps: float = 1e-5
    bias: bool = False  # on the attention and MLP projections
    norm_bias: bool = False
    head_bias: bool = False  # on the prediction head's dense layer
    activation: Literal["gelu", "gelu_tanh", "silu"] = "gelu"
    local_window: int = 128  # the whole local window: local_window // 2 tokens on either side
    layer_types: tuple[str, ...] = ()  # per layer "sliding" or "full"; (): full every third layer, from the first
    global_rope_theta: float = 160000.0
    local_rope_theta: float = 10000.0

    def __post_init__(self):
        check_config(self)
        if self.d_model % self.n_head:
            raise ValueError(f"model.d_model ({self.d_model}) must be divisible by model.n_head ({self.n_head})")
        if not self.d_ff:
            object.__setattr__(self, "d_ff", 3 * self.d_model // 2)
        if not self.layer_types:
            types = tuple("full" if i % 3 == 0 else "sliding" for i in range(self.n_layer))
            object.__setattr__(self, "layer_types", types)
        if len(self.layer_types) != self.n_layer or set(self.layer_types) - {"sliding", "full"}:
            raise ValueError(f"model.layer_types must name 'sliding' or 'full' for each of the {self.n_layer} layers")
        if self.local_window < 2 or min(self.global_rope_theta, self.local_rope_theta) <= 0:
            raise ValueError("model.local_window must be >= 2 and the rotary bases > 0")

    def with_layers(self, n: int) -> ModernBertConfig:
        """Its first n layers (the memory plan probes one and two blocks)."""
        return replace(self, n_layer=n, layer_types=self.layer_types[:n])

    @property
    def context(self) -> int:
        return self.max_seq_len


class PredictionHead(nn.Module):
    """dense, activation, norm: what ModernBERT's classifier and MLM decoder read."""

    def __init__(self, cfg: ModernBertConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.head_bias)
        self.act = ACTIVATIONS[cfg.activation]
        self.norm = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps, bias=cfg.norm_bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.norm(self.act(self.dense(x)))


class ModernBert(TextEncoderTraits, nn.Module):
    """Bidirectional encoder. forward() returns hidden states; pool() is the prediction head on [CLS]."""

    fresh_if_missing = ("head.",)  # a bare ModernBertModel (embedding models) has no prediction head

    def __init__(self, cfg: ModernBertConfig):
        super().__init__()
        if cfg.vocab_size <= 0:
            raise ValueError("model.vocab_size must be set (it is filled in from the tokenizer)")
        self.cfg = cfg
        norm = lambda: nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps, bias=cfg.norm_bias)  # noqa: E731
        head_dim = cfg.d_model // cfg.n_head
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.ln_emb = norm()
        self.drop = nn.Dropout(cfg.dropout)
        self.rotary = Rotary(head_dim, RopeScaling(cfg.global_rope_theta), cfg.max_seq_len)
        self.local_rotary = Rotary(head_dim, RopeScaling(cfg.local_rope_theta), cfg.max_seq_len)
        self.blocks = nn.ModuleList(
            Block(
                Attention(
                    cfg.d_model,
                    cfg.n_head,
                    bias=cfg.bias,
                    dropout=cfg.dropout,
                    window=cfg.local_window // 2 if cfg.layer_types[i] == "sliding" else 0,
                ),
                MLP(cfg.d_model, cfg.d_ff, activation=cfg.activation, bias=cfg.bias, gated=True, dropout=cfg.dropout),
                norm() if i else None,  # the embedding's norm is the first block's
                norm(),
                prenorm=True,
                dropout=cfg.dropout,
            )
            for i in range(cfg.n_layer)
        )
        self.ln_f = norm()
        self.head = PredictionHead(cfg)
        init_normal_(self)

    @property
    def lm_head_weight(self) -> Tensor:
        return self.wte.weight  # the MLM decoder is tied to the token embedding

    def forward(
        self,
        input_ids: Tensor,
        token_type_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        all_layers: bool = False,
    ):
        """input_ids (B, T), attention_mask (B, T) of 1 = token, 0 = pad (token types: none) -> hidden
        states (B, T, D) after the final norm, or with all_layers every block's output (normed)."""
        T = input_ids.size(1)
        if T > self.cfg.max_seq_len:
            raise ValueError(f"sequence of {T} tokens is longer than the model's {self.cfg.max_seq_len} positions")
        pos = torch.arange(T, device=input_ids.device)[None]  # (1, T)
        ropes = {"full": self.rotary(pos), "sliding": self.local_rotary(pos)}  # each (1, T, hs)
        mask = padding_mask(attention_mask) if attention_mask is not None and not bool(attention_mask.all()) else None
        x = self.drop(self.ln_emb(self.wte(input_ids)))  # (B, T, D)
        call = lambda i, block, h: block(h, mask=mask, rope=ropes[self.cfg.layer_types[i]])  # noqa: E731
        return through_blocks(x, self.blocks, call, all_layers, self.ln_f)

    def flops_per_token(self, seq_len: int, target_len: int = 0) -> float:
        return dense_flops_per_token(self, self.cfg.n_layer, seq_len, self.cfg.d_model)

    def pool(self, hidden: Tensor) -> Tensor:
        """(B, T, D) -> (B, D): the prediction head on [CLS] (ModernBertForSequenceClassification's)."""
        return self.head(hidden[:, 0])

    def pool_parameters(self) -> list[nn.Parameter]:
        return list(self.head.parameters())

    def mlm_heads(self) -> nn.ModuleDict:
        """The masked-LM output cloze scoring reads (ModernBertForMaskedLM's): this model's own
        prediction head, the tied embedding, and the output bias (`mlm.bias`, transformers' decoder.bias)."""
        return nn.ModuleDict({"mlm": OutputBias(self.head, self.cfg.vocab_size)})


class OutputBias(nn.Module):
    """The masked-LM output's bias, its transform the model's prediction head (held as a function, not
    a submodule: its weights are the model's, and a run's heads hold only the bias)."""

    def __init__(self, head: nn.Module, vocab_size: int):
        super().__init__()
        self.transform = head.forward
        self.bias = nn.Parameter(torch.zeros(vocab_size))
