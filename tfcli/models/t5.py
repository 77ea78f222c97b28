"""T5 encoder-decoder: relative position bias, RMS norm, no biases, cross-attention, shared blocks.

Built from the same `Block` as every family: pre-norm, RMSNorm, unscaled attention (scale 1.0,
as T5 folds 1/sqrt(d) into the initialisation) whose additive mask carries the relative
position bias. Each stack computes its bias once, from its own bucket embedding, and hands the
same bias to every layer (as T5's first layer does for the rest).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

from .blocks import MLP, Attention, Block, KVCache, causal_mask, check_config, make_norm, padding_mask
from .kinds import ENCODER_DECODER
from .pooling import encoder_decoder_features, encoder_decoder_layer_features


@dataclass(frozen=True)
class T5Config:
    """Shape of a T5. vocab_size 0 means 'take it from the tokenizer'; n_decoder_layer 0 = n_layer."""

    family: str = "t5"
    n_layer: int = 4  # encoder layers
    n_decoder_layer: int = 0
    n_head: int = 4
    d_model: int = 256
    d_kv: int = 0  # per-head width; 0 -> d_model // n_head
    d_ff: int = 1024
    feed_forward: Literal["gated-gelu", "relu"] = "gated-gelu"  # T5 v1.1 | original T5
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    dropout: float = 0.0
    layer_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True  # tied head sees the output scaled by d_model**-0.5 (T5 1.0)
    max_seq_len: int = 512  # longest encoder input and decoder output (the KV cache's size)
    vocab_size: int = 0

    def __post_init__(self):
        check_config(self)
        if not self.n_decoder_layer:
            object.__setattr__(self, "n_decoder_layer", self.n_layer)
        if not self.d_kv:
            if self.d_model % self.n_head:
                raise ValueError(
                    f"model.d_model ({self.d_model}) must be divisible by model.n_head "
                    f"({self.n_head}) unless model.d_kv is set"
                )
            object.__setattr__(self, "d_kv", self.d_model // self.n_head)
        if self.relative_attention_num_buckets < 4:
            raise ValueError("model.relative_attention_num_buckets must be at least 4")


def relative_position_bucket(
    relative_position: Tensor, bidirectional: bool, num_buckets: int, max_distance: int
) -> Tensor:
    """Mesh TensorFlow's bucketing of (key - query) distances: exact for small ones, log-spaced
    up to max_distance, one bucket beyond. Bidirectional splits the buckets by sign."""
    buckets = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets += (relative_position > 0).long() * num_buckets
        relative_position = relative_position.abs()
    else:
        relative_position = -relative_position.clamp(max=0)  # future keys fold onto distance 0
    max_exact = num_buckets // 2
    is_small = relative_position < max_exact
    large = (
        max_exact
        + (
            torch.log(relative_position.float() / max_exact)
            / math.log(max_distance / max_exact)
            * (num_buckets - max_exact)
        ).long()
    )
    large = large.clamp(max=num_buckets - 1)
    return buckets + torch.where(is_small, relative_position, large)


class RelativePositionBias(nn.Module):
    """One learned scalar per (bucket, head), added to the attention logits of every layer."""

    def __init__(self, n_head: int, num_buckets: int, max_distance: int, bidirectional: bool):
        super().__init__()
        self.embedding = nn.Embedding(num_buckets, n_head)
        self.num_buckets, self.max_distance, self.bidirectional = num_buckets, max_distance, bidirectional

    def forward(self, t_query: int, t_key: int, offset: int = 0) -> Tensor:
        """-> (1, nh, Tq, Tk); queries sit at positions offset .. offset+Tq-1 (decoding with a cache)."""
        device = self.embedding.weight.device
        q = torch.arange(offset, offset + t_query, device=device)[:, None]
        k = torch.arange(t_key, device=device)[None, :]
        b = relative_position_bucket(k - q, self.bidirectional, self.num_buckets, self.max_distance)
        return self.embedding(b).permute(2, 0, 1).unsqueeze(0)  # (Tq, Tk, nh) -> (1, nh, Tq, Tk)


def _block(cfg: T5Config, cross: bool) -> Block:
    def attn(is_cross: bool) -> Attention:
        return Attention(
            cfg.d_model, cfg.n_head, head_dim=cfg.d_kv, bias=False, dropout=cfg.dropout, cross=is_cross, scale=1.0
        )

    gated = cfg.feed_forward == "gated-gelu"
    norm = lambda: make_norm("rmsnorm", cfg.d_model, cfg.layer_norm_eps)  # noqa: E731
    return Block(
        attn(False),
        MLP(
            cfg.d_model,
            cfg.d_ff,
            activation="gelu_tanh" if gated else "relu",
            bias=False,
            gated=gated,
            dropout=cfg.dropout,
        ),
        norm(),
        norm(),
        cross_attn=attn(True) if cross else None,
        norm_cross=norm() if cross else None,
        prenorm=True,
        dropout=cfg.dropout,
    )


SENTINELS = tuple(f"<extra_id_{i}>" for i in range(100))


class T5(nn.Module):
    """Encoder-decoder. encode() and decode() return hidden states; logits() applies the LM head."""

    kind = ENCODER_DECODER
    features, layer_features = (
        encoder_decoder_features,
        encoder_decoder_layer_features,
    )  # what a classifier / probe reads
    special_tokens = ("<pad>", "</s>", "<unk>") + SENTINELS  # T5's ids: pad 0, eos 1, unk 2
    poolings = ("encoder-mean", "decoder-first")

    @staticmethod
    def pad_id(tokenizer) -> int:
        """<pad>, which also starts the decoder."""
        return tokenizer.token_id("<pad>") or 0

    def __init__(self, cfg: T5Config):
        super().__init__()
        if cfg.vocab_size <= 0:
            raise ValueError("model.vocab_size must be set (it is filled in from the tokenizer)")
        self.cfg = cfg
        buckets, distance = cfg.relative_attention_num_buckets, cfg.relative_attention_max_distance
        self.shared = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.encoder = nn.ModuleList(_block(cfg, cross=False) for _ in range(cfg.n_layer))
        self.decoder = nn.ModuleList(_block(cfg, cross=True) for _ in range(cfg.n_decoder_layer))
        self.encoder_bias = RelativePositionBias(cfg.n_head, buckets, distance, bidirectional=True)
        self.decoder_bias = RelativePositionBias(cfg.n_head, buckets, distance, bidirectional=False)
        self.encoder_norm = make_norm("rmsnorm", cfg.d_model, cfg.layer_norm_eps)
        self.decoder_norm = make_norm("rmsnorm", cfg.d_model, cfg.layer_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.drop = nn.Dropout(cfg.dropout)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Mesh TensorFlow's T5 initialisation: each matrix at std fan_in**-0.5, the query also
        divided by sqrt(d_kv) (standing in for the attention scale T5 leaves out), embeddings at 1."""
        d, inner = self.cfg.d_model, self.cfg.n_head * self.cfg.d_kv
        normal_ = nn.init.normal_  # through nn.init (the same draws): a model read from a file skips them
        for m in self.modules():
            if isinstance(m, Attention):
                normal_(m.q.weight if m.cross else m.qkv.weight[:inner], 0.0, (d * self.cfg.d_kv) ** -0.5)
                normal_(m.kv.weight if m.cross else m.qkv.weight[inner:], 0.0, d**-0.5)
                normal_(m.out.weight, 0.0, inner**-0.5)
            elif isinstance(m, MLP):
                for lin in (m.up, m.gate):
                    if lin is not None:
                        normal_(lin.weight, 0.0, d**-0.5)
                normal_(m.down.weight, 0.0, self.cfg.d_ff**-0.5)
            elif isinstance(m, nn.RMSNorm):
                nn.init.ones_(m.weight)
        for bias in (self.encoder_bias, self.decoder_bias):
            normal_(bias.embedding.weight, 0.0, d**-0.5)
        normal_(self.shared.weight, 0.0, 1.0)
        if self.lm_head is not None:
            normal_(self.lm_head.weight, 0.0, d**-0.5)

    @property
    def lm_head_weight(self) -> Tensor:
        return self.shared.weight if self.lm_head is None else self.lm_head.weight

    def new_caches(self, max_len: int | None = None) -> list[tuple[KVCache, KVCache]]:
        """(self-attention, cross-attention) caches for each decoder layer."""
        n = max_len or self.cfg.max_seq_len
        return [(KVCache(n), KVCache(0)) for _ in self.decoder]

    def flops_per_token(self, seq_len: int, target_len: int = 0) -> float:
        """Training FLOPs per (encoder + decoder) token, seq_len encoder and target_len decoder tokens:
        6 x parameters each token passes through (cross-attention keys/values run on encoder tokens, the
        LM head on decoder tokens) plus attention's 12 x layers x Tq x Tk x inner width."""
        cfg = self.cfg
        count = lambda mods: sum(p.numel() for m in mods for p in m.parameters())  # noqa: E731
        kv = count(b.cross_attn.kv for b in self.decoder)
        n_enc = count(self.encoder) + kv
        n_dec = count(self.decoder) - kv + cfg.vocab_size * cfg.d_model
        inner = cfg.n_head * cfg.d_kv
        attn = 12 * inner * (cfg.n_layer * seq_len**2 + cfg.n_decoder_layer * (target_len**2 + target_len * seq_len))
        return (6.0 * (n_enc * seq_len + n_dec * target_len) + attn) / (seq_len + target_len)

    def encode(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """input_ids (B, S), attention_mask (B, S) of 1 = token, 0 = pad -> (B, S, D)."""
        S = input_ids.size(1)
        mask = self.encoder_bias(S, S)  # (1, nh, S, S)
        if attention_mask is not None and not bool(attention_mask.all()):
            pad = padding_mask(attention_mask)  # (B, 1, 1, S)
            mask = mask.masked_fill(~pad, torch.finfo(mask.dtype).min)  # (B, nh, S, S)
        x = self.drop(self.shared(input_ids))  # (B, S, D)
        for block in self.encoder:
            x = block(x, mask=mask)
        return self.drop(self.encoder_norm(x))

    def decode(
        self,
        decoder_input_ids: Tensor,
        encoder_out: Tensor,
        encoder_mask: Tensor | None = None,
        caches: list[tuple[KVCache, KVCache]] | None = None,
    ) -> Tensor:
        """decoder_input_ids (B, T) after the cached ones, encoder_out (B, S, D) -> (B, T, D).

        The output is what the LM head sees: with tied embeddings already scaled by d_model**-0.5.
        """
        T = decoder_input_ids.size(1)
        past = caches[0][0].length if caches else 0
        if past + T > self.cfg.max_seq_len:
            raise ValueError(
                f"decoder sequence of {past + T} tokens is longer than model.max_seq_len ({self.cfg.max_seq_len})"
            )
        bias = self.decoder_bias(T, past + T, offset=past)  # (1, nh, T, past+T)
        mask = bias.masked_fill(~causal_mask(T, past + T, bias.device), float("-inf"))
        context_mask = None
        if encoder_mask is not None and not bool(encoder_mask.all()):
            context_mask = padding_mask(encoder_mask)  # (B, 1, 1, S)
        x = self.drop(self.shared(decoder_input_ids))  # (B, T, D)
        for i, block in enumerate(self.decoder):
            self_cache, cross_cache = caches[i] if caches else (None, None)
            x = block(
                x, mask=mask, cache=self_cache, context=encoder_out, context_mask=context_mask, cross_cache=cross_cache
            )
        x = self.drop(self.decoder_norm(x))
        return x * self.cfg.d_model**-0.5 if self.lm_head is None else x

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None, decoder_input_ids: Tensor) -> Tensor:
        """Teacher-forced pass: encode, then decode every target position -> (B, T, D)."""
        return self.decode(decoder_input_ids, self.encode(input_ids, attention_mask), attention_mask)

    def logits(self, hidden: Tensor) -> Tensor:
        """(B, T, D) from decode() -> (B, T, vocab)."""
        return hidden @ self.lm_head_weight.t()
