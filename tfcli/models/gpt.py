"""GPT-2-shaped decoder: learned positions, pre-norm causal blocks, LM head tied to the embedding."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor, nn

from .blocks import (  # noqa: F401
    MLP,
    Attention,
    Block,
    KVCache,
    TiedTable,
    check_config,
    decoder_positions,
    dense_flops_per_token,
    document_positions,
    init_normal_,
    make_norm,
    scale_residual_projections_,
    through_blocks,
)
from .kinds import DECODER, DECODER_POOLINGS
from .pooling import decoder_features, decoder_layer_features


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

    kind, poolings = DECODER, DECODER_POOLINGS
    features, layer_features = decoder_features, decoder_layer_features  # what a classifier / probe reads
    special_tokens = ("<|endoftext|>",)

    @staticmethod
    def pad_id(tokenizer) -> int:
        """End of text: GPT-2 has no pad token (pads are masked, and a right pad is never attended to)."""
        return tokenizer.eos_id or 0

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        if cfg.vocab_size <= 0:
            raise ValueError("model.vocab_size must be set (it is filled in from the tokenizer)")
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.tied = TiedTable()  # the output layer's gradient and the rows' meet in one node
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
        return self.tied.head(self.wte.weight)  # tied, as in GPT-2

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
        """input_ids (B, T) -> hidden states (B, T, D). With caches, T new tokens follow the cached ones.
        all_layers: the embeddings and every block's output (n_layer + 1), each through the final norm
        (features for a classifier or a probe of every depth)
        doc_ids (B, T): packed documents; a token attends within its own document only and its
        position counts from its document's first token in the block.
        key_mask (B, cached + T) of 1 = token, 0 = left padding (batched generation): pads are never
        attended to and positions count real tokens only.
        shared_prompt (B, K): each row a prompt and K replies to it, where each starts
        (blocks.replies_to_one_prompt)."""
        pos, mask = decoder_positions(input_ids, caches, self.cfg.max_seq_len, doc_ids, key_mask, shared_prompt)
        x = self.drop(self.tied.lookup(input_ids, self.wte.weight) + self.wpe(pos))  # (B, T, D)
        call = lambda i, block, h: block(h, mask=mask, causal=True, cache=caches[i] if caches else None)
        return through_blocks(x, self.blocks, call, all_layers, self.ln_f)

    def flops_per_token(self, seq_len: int, target_len: int = 0) -> float:
        """Training FLOPs per token: every weight but the learned positions (the tied LM head included)."""
        return dense_flops_per_token(self, self.cfg.n_layer, seq_len, self.cfg.d_model, lookups=(self.wpe,))

    def logits(self, hidden: Tensor) -> Tensor:
        """(B, T, D) -> (B, T, vocab)."""
        return hidden @ self.lm_head_weight.t()
