"""A linear classifier on pooled backbone features, for text (BERT) and images (ViT) alike.

`features` is the one place that knows how each family's hidden states become a feature vector:
BERT's pooled [CLS] (transformers' BertForSequenceClassification exactly), the mean of the token
outputs, or the [CLS] vectors of the last four layers summed or concatenated; ViT's [CLS] vector
or the mean of its patch vectors.
"""
from __future__ import annotations

from typing import Callable, Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import UserError
from ..models import kinds, model_class
from ..perf import training_flops_multiplier
from ..plugin import Batch
from ..sampler import Draw, Source
from . import Head

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


def _masked_mean(hidden: Tensor, mask: Tensor) -> Tensor:
    """(B, T, D), (B, T) of 1 = token -> (B, D): the mean over real tokens only."""
    m = mask[..., None].to(hidden.dtype)
    return (hidden * m).sum(1) / m.sum(1).clamp(min=1)


def _last4(layers: list[Tensor], pick, pooling: str) -> Tensor:
    picked = [pick(h) for h in layers[-4:]]  # 4 x (B, D)
    return torch.stack(picked).sum(0) if pooling == "last4-sum" else torch.cat(picked, dim=-1)


def decoder_features(model: nn.Module, batch: Batch, pooling: str) -> Tensor:
    """A decoder: the last real token (right padding: causal attention never sees it), the mean, or the
    last token of the last four layers. An encoder-decoder: the mean of the encoder's outputs, or the
    decoder's first position reading the encoder (as a span-corruption decoder fills its first sentinel)."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    if model.kind == kinds.ENCODER_DECODER:
        encoded = model.encode(ids, mask)  # (B, S, D)
        if pooling == "encoder-mean":
            return _masked_mean(encoded, mask)
        return model.decode(batch["decoder_input_ids"], encoded, mask)[:, 0]  # (B, D)
    last = mask.sum(1) - 1  # (B,)
    rows = torch.arange(ids.size(0), device=ids.device)
    if pooling.startswith("last4"):
        return _last4(model(ids, all_layers=True), lambda h: h[rows, last], pooling)
    hidden = model(ids)  # (B, T, D)
    return hidden[rows, last] if pooling == "last" else _masked_mean(hidden, mask)


def features(model: nn.Module, batch: Batch, pooling: str, layer: int = -1) -> Tensor:
    """A batch's inputs -> (B, F) features for the classifier: of the last block, or (layer >= 0) of
    that depth (0: the embeddings; an encoder's cls is then its first token, not BERT's pooler)."""
    if layer >= 0:
        layers = layer_features(model, batch, pooling)
        if layer >= len(layers):
            raise UserError(f"finetune.layer {layer}: this model has depths 0 (the embeddings) to {len(layers) - 1}")
        return layers[layer]
    if model.kind == kinds.VISION_ENCODER:
        return model.pool(model.forward_features(batch["pixels"]), pooling)  # (B, D)
    if model.kind in kinds.GENERATIVE:
        return decoder_features(model, batch, pooling)
    args = (batch["input_ids"], batch["token_type_ids"], batch["attention_mask"])
    if pooling == "cls":
        return model.pool(model(*args))  # BERT's pooler: tanh(dense([CLS]))
    if pooling == "mean":
        return _masked_mean(model(*args), batch["attention_mask"])
    return _last4(model(*args, all_layers=True), lambda h: h[:, 0], pooling)


def layer_features(model: nn.Module, batch: Batch, pooling: str) -> list[Tensor]:
    """Pooled features of every depth, n_layer + 1 of (B, D): the embeddings, then each block's output
    (what `tfcli probe` fits a linear classifier on). Pooling: mean (of real tokens or patches), last
    (a decoder's last real token) or cls (an encoder's first token, not BERT's pooler)."""
    if model.kind == kinds.VISION_ENCODER:
        return [model.pool(h, pooling) for h in model.forward_features(batch["pixels"], all_layers=True)]
    ids, mask = batch["input_ids"], batch["attention_mask"]
    if model.kind == kinds.DECODER:
        layers = model(ids, all_layers=True)
        rows, last = torch.arange(ids.size(0), device=ids.device), mask.sum(1) - 1
        return [h[rows, last] if pooling == "last" else _masked_mean(h, mask) for h in layers]
    if model.kind == kinds.TEXT_ENCODER:
        layers = model(ids, batch["token_type_ids"], mask, all_layers=True)
        return [h[:, 0] if pooling == "cls" else _masked_mean(h, mask) for h in layers]
    raise UserError(f"probe reads a decoder, a text encoder or a vision encoder, not a {model.kind}")


def matmul_params(model: nn.Module) -> int:
    """Parameters in matrix products (embedding tables are lookups and do not count towards MFU)."""
    return sum(p.numel() for p in model.parameters()) - sum(
        p.numel() for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters())


class ExampleSource(Source):
    """Pre-encoded examples batched by `collate`; with `lengths`, batches of similar length."""

    def __init__(self, examples: list, collate: Callable[[list], Batch], lengths: Optional[np.ndarray] = None):
        self.examples, self.collate, self.lengths = examples, collate, lengths

    def epoch_size(self, epoch: int) -> int:
        return len(self.examples)

    def batch(self, draw: Draw) -> Batch:
        return self.collate([self.examples[int(i)] for i in draw.indices])


class ClassifierHead(Head):
    """A linear layer on dropout(pooled features); cross-entropy; the logits are the scores."""

    def __init__(self, cfg, pooling: str, n_labels: int, make_source: Callable[[object, bool], Source],
                 tokens_per_item: float, dropout: float = 0.0, init_std: float = 0.02, item_name: str = "ex",
                 layer: int = -1):
        pooling = resolve_pooling(cfg.family, pooling)
        check_pooling(cfg, pooling)
        if layer > cfg.n_layer:
            raise UserError(f"finetune.layer {layer}: this model has depths 0 (the embeddings) to {cfg.n_layer}")
        self.item_name, self.layer = item_name, layer
        self.pooling, self.dropout, self.make_source, self.tokens_per_item = pooling, dropout, make_source, tokens_per_item
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
            n_tokens = sum(p.numel() for p in model.encoder.parameters()) * tokens + \
                (sum(p.numel() for p in model.decoder.parameters()) if self.pooling == "decoder-first" else 0)
        else:
            n_tokens = matmul_params(model) * tokens
        attention = 12.0 * cfg.n_layer * tokens * cfg.d_model * tokens
        return training_flops_multiplier(train) * n_tokens + attention * training_flops_multiplier(train) / 6.0
