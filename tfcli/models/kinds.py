"""Model kinds: what tasks, generation and the trainer may ask of a model. Code outside `models/`
and `hf/` asks a model's kind (and what its family declares), never its family's name.

Each family's model class declares:
  kind            one of the four below
  special_tokens  what a tokenizer trained for it must hold (pad, end of text, ...)
  poolings        the features a classifier head may read, the first being `auto`'s choice
  pad_id(tok)     the token its batches are padded with
  reads_images    (optional, False when not declared) whether it takes pixels beside its text
and `models.transformer_blocks` finds its blocks (what FSDP shards and activation checkpointing
recomputes) by type, whatever the family.
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol, runtime_checkable

from torch import Tensor

DECODER = "decoder"  # a causal language model: GPT, llama
ENCODER_DECODER = "encoder-decoder"  # T5
TEXT_ENCODER = "text-encoder"  # BERT
VISION_ENCODER = "vision-encoder"  # ViT
KINDS = (DECODER, ENCODER_DECODER, TEXT_ENCODER, VISION_ENCODER)
DECODER_POOLINGS = ("last", "mean", "last4-sum", "last4-concat")  # what a decoder's classifier may read
GENERATIVE = (DECODER, ENCODER_DECODER)  # what `tfcli generate` and text-to-text tasks run


def is_seq2seq(model) -> bool:
    """How the model is given a prompt and a target: the prompt to its encoder and the target to its
    decoder (an encoder-decoder), rather than both in one sequence (a decoder)."""
    return model.kind == ENCODER_DECODER


def reads_images(model) -> bool:
    """Whether a model (or a family's model class) takes images beside its text, as its class declares
    (models/vlm.py): the one way tasks, data and export ask it."""
    return bool(getattr(model, "reads_images", False))


@runtime_checkable
class DecoderLM(Protocol):
    """forward(input_ids (B, T), caches, all_layers, doc_ids, key_mask, shared_prompt) -> hidden (B, T, D)."""

    kind: ClassVar[str]
    cfg: Any

    def forward(
        self,
        input_ids: Tensor,
        caches: list | None = None,
        all_layers: bool = False,
        doc_ids: Tensor | None = None,
        key_mask: Tensor | None = None,
        shared_prompt: Tensor | None = None,
    ) -> Any: ...

    def logits(self, hidden: Tensor) -> Tensor: ...

    def new_caches(self, max_len: int | None = None) -> list: ...

    def flops_per_token(self, seq_len: int, target_len: int = 0) -> float: ...  # training FLOPs (MFU)

    def features(self, batch: dict, pooling: str) -> Tensor: ...  # (B, F): what a classifier reads (models/pooling.py)

    def layer_features(self, batch: dict, pooling: str) -> list: ...  # n_layer + 1 of (B, D): what a probe reads


@runtime_checkable
class EncoderDecoder(Protocol):
    """encode(input_ids, attention_mask) -> (B, S, D); decode(decoder_input_ids, encoder_out,
    encoder_mask, caches) -> (B, T, D)."""

    kind: ClassVar[str]
    cfg: Any

    def encode(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor: ...

    def decode(
        self,
        decoder_input_ids: Tensor,
        encoder_out: Tensor,
        encoder_mask: Tensor | None = None,
        caches: list | None = None,
    ) -> Tensor: ...

    def logits(self, hidden: Tensor) -> Tensor: ...

    def new_caches(self, max_len: int | None = None) -> list: ...

    def flops_per_token(self, seq_len: int, target_len: int = 0) -> float: ...  # training FLOPs (MFU)

    def features(self, batch: dict, pooling: str) -> Tensor: ...  # (B, F): what a classifier reads (models/pooling.py)

    def layer_features(self, batch: dict, pooling: str) -> list: ...  # n_layer + 1 of (B, D): what a probe reads


@runtime_checkable
class TextEncoder(Protocol):
    """forward(input_ids, token_type_ids, attention_mask, all_layers) -> (B, T, D); pool(hidden) -> (B, D)."""

    kind: ClassVar[str]
    cfg: Any

    def forward(
        self,
        input_ids: Tensor,
        token_type_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        all_layers: bool = False,
    ) -> Any: ...

    def pool(self, hidden: Tensor) -> Tensor: ...

    def pool_parameters(self) -> list: ...  # what pool() alone reads: frozen when nothing calls it

    def flops_per_token(self, seq_len: int, target_len: int = 0) -> float: ...  # training FLOPs (MFU)

    def features(self, batch: dict, pooling: str) -> Tensor: ...  # (B, F): what a classifier reads (models/pooling.py)

    def layer_features(self, batch: dict, pooling: str) -> list: ...  # n_layer + 1 of (B, D): what a probe reads


@runtime_checkable
class VisionEncoder(Protocol):
    """forward_features(pixels (B, C, H, W)) -> (B, 1 + N, D); pool(hidden, pooling) -> (B, D)."""

    kind: ClassVar[str]
    cfg: Any

    def forward_features(self, pixels: Tensor) -> Tensor: ...

    def pool(self, hidden: Tensor, pooling: str) -> Tensor: ...

    def flops_per_token(self, seq_len: int, target_len: int = 0) -> float: ...  # training FLOPs (MFU)

    def features(self, batch: dict, pooling: str) -> Tensor: ...  # (B, F): what a classifier reads (models/pooling.py)

    def layer_features(self, batch: dict, pooling: str) -> list: ...  # n_layer + 1 of (B, D): what a probe reads


PROTOCOLS = {
    DECODER: DecoderLM,
    ENCODER_DECODER: EncoderDecoder,
    TEXT_ENCODER: TextEncoder,
    VISION_ENCODER: VisionEncoder,
}
