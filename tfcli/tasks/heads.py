"""A linear classifier on pooled backbone features, for text (BERT, GPT, T5) and images (ViT) alike.

How a model's hidden states become a feature vector is the model's to say (its `features` and
`layer_features`, models/pooling.py): BERT's pooled [CLS], the mean of the token outputs, the last
four layers; a decoder's last token; T5's encoder mean; ViT's [CLS] or the mean of its patches.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch.nn.functional as F
from torch import Tensor, nn

from ..data.sampler import Draw, Source
from ..engine.perf import training_flops_multiplier
from ..errors import UserError
from ..models import kinds, model_class
from ..plugin import Batch
from .classification import Head


def resolve_pooling(family: str, pooling: str) -> str:
    """`auto`: the family's natural summary, the first of its declared poolings: [CLS] (BERT, ViT),
    the last token (decoders), the mean of the encoder's outputs (T5)."""
    return model_class(family).poolings[0] if pooling == "auto" else pooling


def check_pooling(cfg, pooling: str) -> None:
    allowed = model_class(cfg.family).poolings
    if pooling not in allowed:
        raise UserError(f"--pooling {pooling}: a {cfg.family} classifier pools {', '.join(allowed) or 'nothing'}")
    if pooling.startswith("last4") and cfg.n_layer < 4:
        raise UserError(f"--pooling {pooling} needs at least 4 layers; this model has {cfg.n_layer}")


def feature_dim(cfg, pooling: str) -> int:
    return 4 * cfg.d_model if pooling == "last4-concat" else cfg.d_model


def features(model: nn.Module, batch: Batch, pooling: str, layer: int = -1) -> Tensor:
    """A batch's inputs -> (B, F) features for the classifier: of the last block, or (layer >= 0) of
    that depth (0: the embeddings; an encoder's cls is then its first token, not BERT's pooler). The
    model says how it pools (models/pooling.py)."""
    if layer < 0:
        return model.features(batch, pooling)
    layers = model.layer_features(batch, pooling)
    if layer >= len(layers):
        raise UserError(f"--layer {layer}: this model has depths 0 (the embeddings) to {len(layers) - 1}")
    return layers[layer]


def matmul_params(model: nn.Module) -> int:
    """Parameters in matrix products (embedding tables are lookups and do not count towards MFU)."""
    return sum(p.numel() for p in model.parameters()) - sum(
        p.numel() for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()
    )


class ExampleSource(Source):
    """Pre-encoded examples batched by `collate`; with `lengths`, batches of similar length."""

    def __init__(self, examples: list, collate: Callable[[list], Batch], lengths: np.ndarray | None = None):
        self.examples, self.collate, self.lengths = examples, collate, lengths

    def epoch_size(self, epoch: int) -> int:
        return len(self.examples)

    def batch(self, draw: Draw) -> Batch:
        return self.collate([self.examples[int(i)] for i in draw.indices])


class ClassifierHead(Head):
    """A linear layer on dropout(pooled features); cross-entropy; the logits are the scores."""

    def __init__(
        self,
        cfg,
        pooling: str,
        n_labels: int,
        make_source: Callable[[object, bool], Source],
        tokens_per_item: float,
        dropout: float = 0.0,
        init_std: float = 0.02,
        item_name: str = "ex",
        layer: int = -1,
    ):
        pooling = resolve_pooling(cfg.family, pooling)
        check_pooling(cfg, pooling)
        if layer > cfg.n_layer:
            raise UserError(f"--layer {layer}: this model has depths 0 (the embeddings) to {cfg.n_layer}")
        self.item_name, self.layer = item_name, layer
        self.pooling, self.dropout, self.make_source, self.tokens_per_item = (
            pooling,
            dropout,
            make_source,
            tokens_per_item,
        )
        linear = nn.Linear(feature_dim(cfg, pooling), n_labels)
        nn.init.trunc_normal_(linear.weight, std=init_std)
        nn.init.zeros_(linear.bias)
        self.heads = nn.ModuleDict({"classifier": linear})

    def unread(self, model: nn.Module) -> tuple:
        """A text encoder's pooler, unless these features are the last layer's [CLS] through it."""
        return () if self.pooling == "cls" and self.layer < 0 else super().unread(model)

    def source(self, data, train: bool) -> Source:
        return self.make_source(data, train)

    def scores(self, model: nn.Module, heads: nn.ModuleDict, batch: Batch) -> Tensor:
        return heads["classifier"](features(model, batch, self.pooling, self.layer))  # (B, n_labels)

    def loss(self, model: nn.Module, heads: nn.ModuleDict, batch: Batch):
        feats = F.dropout(features(model, batch, self.pooling, self.layer), self.dropout, training=model.training)
        logits = heads["classifier"](feats)  # (B, n_labels)
        value = F.cross_entropy(logits.float(), batch["labels"])
        return value, {"loss": value.detach(), "acc": (logits.argmax(-1) == batch["labels"]).float().mean()}

    def flops_per_item(self, model: nn.Module, data, train: str) -> float:
        """The FLOPs of what the features run: every block for a GPT, BERT or ViT, the encoder for a T5
        (and, for decoder-first, its decoder at one position), plus attention's 12 L T D per token."""
        cfg, tokens = model.cfg, self.tokens_per_item
        if model.kind == kinds.ENCODER_DECODER:
            n_tokens = sum(p.numel() for p in model.encoder.parameters()) * tokens + (
                sum(p.numel() for p in model.decoder.parameters()) if self.pooling == "decoder-first" else 0
            )
        else:
            n_tokens = matmul_params(model) * tokens
        attention = 12.0 * cfg.n_layer * tokens * cfg.d_model * tokens
        return training_flops_multiplier(train) * n_tokens + attention * training_flops_multiplier(train) / 6.0
