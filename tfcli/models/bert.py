"""BERT-shaped encoder: token + segment + learned position embeddings, post-norm blocks, pooler.

The model returns hidden states (and, when asked, every layer's for last-4 pooling); the MLM and
NSP heads belong to the objective (tfcli.objectives.mlm_nsp), the classifier to the task.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

from ..errors import UserError
from .blocks import (
    ACTIVATIONS,
    MLP,
    Attention,
    Block,
    check_config,
    dense_flops_per_token,
    init_normal_,
    make_norm,
    padding_mask,
    through_blocks,
)
from .pooling import TextEncoderTraits


@dataclass(frozen=True)
class BertConfig:
    """Shape of a BERT. vocab_size 0 means 'take it from the tokenizer'."""

    family: str = "bert"
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 256
    d_ff: int = 0  # 0 -> 4 * d_model
    max_seq_len: int = 512  # max_position_embeddings
    type_vocab_size: int = 2
    vocab_size: int = 0
    dropout: float = 0.1  # hidden and attention-probability dropout, as in BERT
    layer_norm_eps: float = 1e-12
    activation: Literal["gelu", "gelu_tanh", "relu"] = "gelu"
    position_offset: int = 0  # RoBERTa: positions count from pad id + 1 (2), so max_seq_len - 2 tokens fit
    segments: bool = True  # reads a pair's segment ids; RoBERTa does not (its tokenizer gives none: type 0 throughout)
    hf_model_type: str = "bert"  # the Hugging Face architecture it came from / exports as (bert, roberta, ...)

    def __post_init__(self):
        check_config(self)
        if self.d_model % self.n_head:
            raise ValueError(f"model.d_model ({self.d_model}) must be divisible by model.n_head ({self.n_head})")
        if self.type_vocab_size < 1:
            raise ValueError("model.type_vocab_size must be at least 1")
        if not 0 <= self.position_offset < self.max_seq_len:
            raise ValueError("model.position_offset must be in [0, model.max_seq_len)")
        if not self.d_ff:
            object.__setattr__(self, "d_ff", 4 * self.d_model)

    @property
    def context(self) -> int:
        """The longest input, in tokens (RoBERTa's first positions are taken by its offset)."""
        return self.max_seq_len - self.position_offset


def encoder_blocks(cfg: BertConfig) -> nn.ModuleList:
    """BERT's post-norm blocks for a BertConfig (the encoder, or an ELECTRA generator's)."""
    return nn.ModuleList(
        Block(
            Attention(cfg.d_model, cfg.n_head, dropout=cfg.dropout),
            MLP(cfg.d_model, cfg.d_ff, activation=cfg.activation),
            make_norm("layernorm", cfg.d_model, cfg.layer_norm_eps),
            make_norm("layernorm", cfg.d_model, cfg.layer_norm_eps),
            prenorm=False,  # BERT: norm(x + f(x))
            dropout=cfg.dropout,
        )
        for _ in range(cfg.n_layer)
    )


def run_blocks(blocks: nn.ModuleList, x: Tensor, attention_mask: Tensor | None, all_layers: bool = False):
    """x (B, T, D) through the blocks with padded keys masked -> (B, T, D), or (all_layers) the embeddings
    and every block's output (n_layer + 1)."""
    # no mask at all when nothing is padded: SDPA's fastest path
    mask = padding_mask(attention_mask) if attention_mask is not None and not bool(attention_mask.all()) else None
    return through_blocks(x, blocks, lambda i, block, h: block(h, mask=mask), all_layers)


class Bert(TextEncoderTraits, nn.Module):
    """Bidirectional encoder. forward() returns hidden states; pool() is BERT's tanh pooler on [CLS]."""

    fresh_if_missing = ("pooler.",)  # BertForMaskedLM is saved without it: initialised fresh

    def __init__(self, cfg: BertConfig):
        super().__init__()
        if cfg.vocab_size <= 0:
            raise ValueError("model.vocab_size must be set (it is filled in from the tokenizer)")
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.max_seq_len, cfg.d_model)
        self.wse = nn.Embedding(cfg.type_vocab_size, cfg.d_model)  # segment (token type) embeddings
        self.ln_emb = make_norm("layernorm", cfg.d_model, cfg.layer_norm_eps)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = encoder_blocks(cfg)
        self.pooler = nn.Linear(cfg.d_model, cfg.d_model)
        init_normal_(self)

    @property
    def lm_head_weight(self) -> Tensor:
        return self.wte.weight  # the MLM decoder is tied to the token embedding

    def embed(self, input_ids: Tensor, token_type_ids: Tensor | None = None) -> Tensor:
        """input_ids (B, T), token_type_ids (B, T) of 0/1 -> normalised embeddings (B, T, D)."""
        T, offset = input_ids.size(1), self.cfg.position_offset
        if T + offset > self.cfg.max_seq_len:
            raise ValueError(
                f"sequence of {T} tokens is longer than the model's {self.cfg.max_seq_len - offset} positions"
            )
        x = self.wte(input_ids) + self.wpe(torch.arange(offset, offset + T, device=input_ids.device))  # (B, T, D)
        segments = token_type_ids is not None and self.cfg.segments
        x = x + (self.wse(token_type_ids) if segments else self.wse.weight[0])
        return self.drop(self.ln_emb(x))

    def forward(
        self,
        input_ids: Tensor,
        token_type_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        all_layers: bool = False,
    ):
        """input_ids (B, T), token_type_ids (B, T), attention_mask (B, T) of 1 = token, 0 = pad
        -> hidden states (B, T, D), or with all_layers the list of every block's output (last = final)."""
        return run_blocks(self.blocks, self.embed(input_ids, token_type_ids), attention_mask, all_layers)

    def flops_per_token(self, seq_len: int, target_len: int = 0) -> float:
        """Training FLOPs per token: every weight but the learned positions (the MLM decoder is tied to
        the token embedding)."""
        return dense_flops_per_token(self, self.cfg.n_layer, seq_len, self.cfg.d_model, lookups=(self.wpe,))

    def pool(self, hidden: Tensor) -> Tensor:
        """(B, T, D) -> (B, D): tanh(dense(hidden of [CLS]))."""
        return torch.tanh(self.pooler(hidden[:, 0]))

    def pool_parameters(self) -> list[nn.Parameter]:
        """The pooler's weights: read by pool() and nothing else, so a run that never pools (mean
        pooling, MLM without NSP, ELECTRA) does not train them."""
        return list(self.pooler.parameters())

    def mlm_heads(self) -> nn.ModuleDict:
        """The masked-LM head cloze scoring reads (BertForMaskedLM's: transform, tied embedding, bias)."""
        return build_heads(self.cfg, nsp=False)


# --- BERT's pretraining head and special tokens: the MLM objective trains them, cloze scoring reads them


class MLMHead(nn.Module):
    """BERT's prediction-head transform (dense, activation, LayerNorm) and the output bias; the
    output weight is the token embedding (tied). `d_in` may be narrower than the embedding (an
    ELECTRA generator's hidden width)."""

    def __init__(self, d_in: int, d_embed: int, vocab_size: int, eps: float, activation: str = "gelu"):
        super().__init__()
        self.dense = nn.Linear(d_in, d_embed)
        self.act = ACTIVATIONS[activation]
        self.norm = make_norm("layernorm", d_embed, eps)
        self.bias = nn.Parameter(torch.zeros(vocab_size))

    def transform(self, hidden: Tensor) -> Tensor:
        return self.norm(self.act(self.dense(hidden)))

    def logits(self, hidden: Tensor, weight: Tensor) -> Tensor:
        """(..., d_in) -> (..., V): every logit (for sampling, parity checks and inspection)."""
        return self.transform(hidden) @ weight.t() + self.bias


def build_heads(cfg, nsp: bool = True) -> nn.ModuleDict:
    """The pretraining heads for a BertConfig: 'mlm' and (with NSP) 'nsp' on the pooled [CLS]."""
    heads = nn.ModuleDict(
        {"mlm": MLMHead(cfg.d_model, cfg.d_model, cfg.vocab_size, cfg.layer_norm_eps, cfg.activation)}
    )
    if nsp:
        heads["nsp"] = nn.Linear(cfg.d_model, 2)
    init_normal_(heads)
    return heads


BERT_SPECIALS = {"pad": "[PAD]", "unk": "[UNK]", "cls": "[CLS]", "sep": "[SEP]", "mask": "[MASK]"}
ROBERTA_SPECIALS = {"pad": "<pad>", "unk": "<unk>", "cls": "<s>", "sep": "</s>", "mask": "<mask>"}


def special_ids(tokenizer) -> dict[str, int]:
    """The ids of the encoder's special tokens: BERT's WordPiece [CLS] ... [SEP], or RoBERTa's byte-level
    <s> ... </s> (which also separates a pair with two </s>: `pair_sep`)."""
    for names, pair in ((BERT_SPECIALS, 1), (ROBERTA_SPECIALS, 2)):
        out = {k: tokenizer.token_id(v) for k, v in names.items()}
        if all(v is not None for v in out.values()):
            return {**out, "pair_sep": pair}
    missing = [v for k, v in BERT_SPECIALS.items() if tokenizer.token_id(v) is None]
    raise UserError(
        f"the tokenizer lacks {', '.join(missing)}, which BERT needs (a BERT WordPiece vocabulary, or "
        f"RoBERTa's <s> </s> <pad> <unk> <mask>)"
    )
