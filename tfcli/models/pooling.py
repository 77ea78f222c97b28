"""How each kind of model turns a batch into feature vectors: what a classifier on pooled features
and `tfcli probe` read. The families take these as methods (`features`, `layer_features` in their
kind's protocol, models/kinds.py), so a task asks the model and never its kind.

BERT's pooled [CLS] is transformers' BertForSequenceClassification exactly; the mean is over real
tokens (or patches) only; last4 sums or concatenates the last four layers' summary vectors.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..errors import UserError
from .kinds import DECODER, DECODER_POOLINGS, TEXT_ENCODER


def masked_mean(hidden: Tensor, mask: Tensor) -> Tensor:
    """(B, T, D), (B, T) of 1 = token -> (B, D): the mean over real tokens only."""
    m = mask[..., None].to(hidden.dtype)
    return (hidden * m).sum(1) / m.sum(1).clamp(min=1)


def last4(layers: list[Tensor], pick, pooling: str) -> Tensor:
    picked = [pick(h) for h in layers[-4:]]  # 4 x (B, D)
    return torch.stack(picked).sum(0) if pooling == "last4-sum" else torch.cat(picked, dim=-1)


def _last_rows(batch: dict) -> tuple[Tensor, Tensor]:
    """(rows, index of each row's last real token): right padding, which causal attention never sees."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    return torch.arange(ids.size(0), device=ids.device), mask.sum(1) - 1


# --- decoders (GPT, llama): the last real token, the mean, or the last token of the last four layers


def decoder_features(model, batch: dict, pooling: str) -> Tensor:
    ids, mask = batch["input_ids"], batch["attention_mask"]
    rows, last = _last_rows(batch)
    if pooling.startswith("last4"):
        return last4(model(ids, all_layers=True), lambda h: h[rows, last], pooling)
    hidden = model(ids)  # (B, T, D)
    return hidden[rows, last] if pooling == "last" else masked_mean(hidden, mask)


def decoder_layer_features(model, batch: dict, pooling: str) -> list[Tensor]:
    rows, last = _last_rows(batch)
    layers = model(batch["input_ids"], all_layers=True)
    return [h[rows, last] if pooling == "last" else masked_mean(h, batch["attention_mask"]) for h in layers]


# --- encoder-decoders (T5): the mean of the encoder's outputs, or the decoder's first position reading
# the encoder (as a span-corruption decoder fills its first sentinel)


def encoder_decoder_features(model, batch: dict, pooling: str) -> Tensor:
    ids, mask = batch["input_ids"], batch["attention_mask"]
    encoded = model.encode(ids, mask)  # (B, S, D)
    if pooling == "encoder-mean":
        return masked_mean(encoded, mask)
    return model.decode(batch["decoder_input_ids"], encoded, mask)[:, 0]  # (B, D)


def encoder_decoder_layer_features(model, batch: dict, pooling: str) -> list[Tensor]:
    raise UserError(f"probe reads a decoder, a text encoder or a vision encoder, not a {model.kind}")


# --- text encoders (BERT): the pooler on [CLS], the mean, or [CLS] of the last four layers


def text_encoder_features(model, batch: dict, pooling: str) -> Tensor:
    args = (batch["input_ids"], batch["token_type_ids"], batch["attention_mask"])
    if pooling == "cls":
        return model.pool(model(*args))  # BERT's pooler: tanh(dense([CLS]))
    if pooling == "mean":
        return masked_mean(model(*args), batch["attention_mask"])
    return last4(model(*args, all_layers=True), lambda h: h[:, 0], pooling)


def text_encoder_layer_features(model, batch: dict, pooling: str) -> list[Tensor]:
    """cls at a depth is that layer's first token (BERT's pooler reads only the last)."""
    mask = batch["attention_mask"]
    layers = model(batch["input_ids"], batch["token_type_ids"], mask, all_layers=True)
    return [h[:, 0] if pooling == "cls" else masked_mean(h, mask) for h in layers]


# --- vision encoders (ViT): [CLS] or the mean of the patch vectors


def vision_features(model, batch: dict, pooling: str) -> Tensor:
    return model.pool(model.forward_features(batch["pixels"]), pooling)  # (B, D)


def vision_layer_features(model, batch: dict, pooling: str) -> list[Tensor]:
    return [model.pool(h, pooling) for h in model.forward_features(batch["pixels"], all_layers=True)]


# --- what each kind's families declare alike (models/kinds.py): inherited, never repeated


class DecoderTraits:
    """A Llama-style decoder's declarations: its kind and poolings, what a classifier or probe reads, its
    special tokens, and its pad: the tokenizer's own pad token when it names one, else end of text."""

    kind, poolings = DECODER, DECODER_POOLINGS
    features, layer_features = decoder_features, decoder_layer_features
    special_tokens: tuple[str, ...] = ("<|endoftext|>",)

    @staticmethod
    def pad_id(tokenizer) -> int:
        pad = tokenizer.token_id(tokenizer.specials.pad) if tokenizer.specials.pad else None
        return pad if pad is not None else (tokenizer.eos_id or 0)


class TextEncoderTraits:
    """A BERT-style text encoder's declarations: its kind and poolings, what a classifier or probe reads,
    BERT's special tokens, and its pad: [PAD], or RoBERTa's <pad>."""

    kind, poolings = TEXT_ENCODER, ("cls", "mean", "last4-sum", "last4-concat")
    features, layer_features = text_encoder_features, text_encoder_layer_features
    special_tokens: tuple[str, ...] = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")

    @staticmethod
    def pad_id(tokenizer) -> int:
        return next((i for i in map(tokenizer.token_id, ("[PAD]", "<pad>")) if i is not None), 0)
