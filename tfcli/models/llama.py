"""Llama-shaped decoder (Llama 2/3, Qwen2/2.5/3, Mistral, SmolLM, TinyLlama): RMSNorm, SwiGLU,
rotary positions, grouped-query attention, tied or untied LM head; qkv (and output) biases, per-head
q/k norms and a sliding window where an architecture has them. Built from the shared parts only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor, nn

from .blocks import (
    MLP,
    Attention,
    Block,
    KVCache,
    check_config,
    decoder_positions,
    dense_flops_per_token,
    init_normal_,
    make_norm,
    through_blocks,
)
from .kinds import DECODER, DECODER_POOLINGS
from .pooling import decoder_features, decoder_layer_features
from .rotary import RopeScaling, Rotary, check_rope


@dataclass(frozen=True)
class LlamaConfig:
    """Shape of a llama-family decoder. vocab_size 0: from the tokenizer; n_kv_head 0: n_head (no
    grouping); head_dim 0: d_model // n_head."""

    family: str = "llama"
    n_layer: int = 4
    n_head: int = 4
    n_kv_head: int = 0
    head_dim: int = 0
    rope: RopeScaling = field(default_factory=RopeScaling)  # rotary positions: theta and scaling
    d_model: int = 256
    d_ff: int = 0  # 0 -> SwiGLU's 8/3 * d_model, rounded up to a multiple of 64
    max_seq_len: int = 256  # the context (max_position_embeddings)
    vocab_size: int = 0
    dropout: float = 0.0
    layer_norm_eps: float = 1e-5  # RMSNorm's eps
    tie_word_embeddings: bool = True
    qkv_bias: bool = False  # Qwen2: biases on q, k, v
    out_bias: bool = False  # Llama's attention_bias: on the output projection too
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm of each query and key head
    sliding_window: int = 0  # Mistral: a token attends to the last N positions (0: all)
    hf_model_type: str = "llama"  # the Hugging Face architecture it came from / exports as

    def __post_init__(self):
        check_config(self)
        if not self.n_kv_head:
            object.__setattr__(self, "n_kv_head", self.n_head)
        if self.n_head % self.n_kv_head:
            raise ValueError(f"model.n_head ({self.n_head}) must be a multiple of model.n_kv_head ({self.n_kv_head})")
        if not self.head_dim:
            if self.d_model % self.n_head:
                raise ValueError(
                    f"model.d_model ({self.d_model}) must be divisible by model.n_head ({self.n_head}) "
                    f"unless model.head_dim is set"
                )
            object.__setattr__(self, "head_dim", self.d_model // self.n_head)
        if self.head_dim % 2:
            raise ValueError(f"model.head_dim ({self.head_dim}) must be even for rotary positions")
        if not self.d_ff:
            object.__setattr__(self, "d_ff", -(-(8 * self.d_model // 3) // 64) * 64)
        if self.sliding_window < 0:
            raise ValueError(f"model.sliding_window must be >= 0, got {self.sliding_window}")
        check_rope(self.rope)


class Llama(nn.Module):
    """Decoder-only transformer. forward() returns hidden states; logits() applies the LM head."""

    kind, poolings = DECODER, DECODER_POOLINGS
    features, layer_features = decoder_features, decoder_layer_features  # what a classifier / probe reads
    special_tokens = ("<|endoftext|>",)

    @staticmethod
    def pad_id(tokenizer) -> int:
        """Its own pad token when the tokenizer names one, else end of text (pads are masked)."""
        pad = tokenizer.token_id(tokenizer.specials.pad) if tokenizer.specials.pad else None
        return pad if pad is not None else (tokenizer.eos_id or 0)

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        if cfg.vocab_size <= 0:
            raise ValueError("model.vocab_size must be set (it is filled in from the tokenizer)")
        self.cfg = cfg
        rms = lambda d: make_norm("rmsnorm", d, cfg.layer_norm_eps)  # noqa: E731
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.rotary = Rotary(cfg.head_dim, cfg.rope, cfg.max_seq_len)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(
            Block(
                Attention(
                    cfg.d_model,
                    cfg.n_head,
                    n_kv_head=cfg.n_kv_head,
                    head_dim=cfg.head_dim,
                    bias=cfg.qkv_bias,
                    out_bias=cfg.out_bias,
                    dropout=cfg.dropout,
                    qk_norm=rms if cfg.qk_norm else None,
                    window=cfg.sliding_window,
                ),
                MLP(cfg.d_model, cfg.d_ff, activation="silu", bias=cfg.mlp_bias, gated=True, dropout=cfg.dropout),
                rms(cfg.d_model),
                rms(cfg.d_model),
                prenorm=True,
                dropout=cfg.dropout,
            )
            for _ in range(cfg.n_layer)
        )
        self.ln_f = rms(cfg.d_model)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        init_normal_(self)

    @property
    def lm_head_weight(self) -> Tensor:
        return self.wte.weight if self.lm_head is None else self.lm_head.weight

    def new_caches(self, max_len: int | None = None) -> list[KVCache]:
        return [KVCache(max_len or self.cfg.max_seq_len) for _ in self.blocks]

    def forward(
        self,
        input_ids: Tensor,
        caches: list[KVCache] | None = None,
        all_layers: bool = False,
        doc_ids: Tensor | None = None,
        key_mask: Tensor | None = None,
        shared_prompt: Tensor | None = None,
    ):
        """input_ids (B, T) -> hidden states (B, T, D); the arguments mean what they mean for GPT
        (blocks.decoder_positions): caches, every layer's output, packed documents, left padding."""
        pos, mask = decoder_positions(input_ids, caches, self.cfg.max_seq_len, doc_ids, key_mask, shared_prompt)
        rope = self.rotary(pos if pos.dim() == 2 else pos[None])  # each (B or 1, T, hs)
        x = self.drop(self.wte(input_ids))  # (B, T, D)
        call = lambda i, block, h: block(h, mask=mask, causal=True, cache=caches[i] if caches else None, rope=rope)
        return through_blocks(x, self.blocks, call, all_layers, self.ln_f)

    def flops_per_token(self, seq_len: int, target_len: int = 0) -> float:
        """Training FLOPs per token: every weight (rotary positions are computed, not learned); attention
        at the query width n_head x head_dim."""
        return dense_flops_per_token(self, self.cfg.n_layer, seq_len, self.cfg.n_head * self.cfg.head_dim)

    def logits(self, hidden: Tensor) -> Tensor:
        """(B, T, D) -> (B, T, vocab)."""
        return hidden @ self.lm_head_weight.t()
