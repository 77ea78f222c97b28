"""Model families by registry key: the recipe's `model.family` picks the config and the class.

A new family is its module here (a config dataclass and a model class declaring its kind, special
tokens, poolings and pad rule: see kinds.py) and one line in FAMILIES.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from . import kinds
from .bert import Bert, BertConfig
from .generic import TransformersConfig, TransformersDecoder, TransformersEncoder, TransformersEncoderConfig
from .gpt import GPT, GPTConfig
from .llama import Llama, LlamaConfig
from .modernbert import ModernBert, ModernBertConfig
from .t5 import T5, T5Config
from .vit import ViT, ViTConfig
from .vlm import VisionLanguage, VLMConfig

FAMILIES: dict[str, tuple[type, type[Any]]] = {
    "gpt": (GPTConfig, GPT),
    "llama": (LlamaConfig, Llama),
    "t5": (T5Config, T5),
    "bert": (BertConfig, Bert),
    "modernbert": (ModernBertConfig, ModernBert),
    "vit": (ViTConfig, ViT),
    "vlm": (VLMConfig, VisionLanguage),  # a ViT, a projector and a llama-family decoder
    # any other architecture transformers ships, through its own modules (the optional extra)
    "generic": (TransformersConfig, TransformersDecoder),
    "generic-encoder": (TransformersEncoderConfig, TransformersEncoder),
}


def model_class(family: str) -> type[Any]:
    return FAMILIES[family][1]


def kind_of(family: str) -> str:
    """The kind (kinds.DECODER, ...) a family's models are."""
    return model_class(family).kind


def families_of(wanted: tuple[str, ...]) -> tuple[str, ...]:
    """The families of the given kinds, in the order of the kinds (then of FAMILIES)."""
    return tuple(f for k in wanted for f in FAMILIES if kind_of(f) == k)


COMPOSED = "vlm"  # the family `finetune --vision-from` composes from a vision run and a decoder (engine/compose.py)
TEXT_FAMILIES = tuple(f for f in FAMILIES if kind_of(f) != kinds.VISION_ENCODER)  # those with a tokenizer


def transformer_blocks(module) -> list:
    """Every transformer block inside `module` (a model, or a model with heads): what FSDP shards one
    by one and activation checkpointing recomputes."""
    from .blocks import Block

    own = [m for m in module.modules() if isinstance(m, Block)]
    wrapped = [m for m in module.modules() if hasattr(m, "decoder_layers")]  # models/generic.py: transformers' layers
    return own or [layer for m in wrapped for layer in m.decoder_layers()]


def build_model(cfg, weights_follow: bool = False):
    """Instantiate the model class registered for cfg.family. weights_follow: every weight is read
    right after (a checkpoint, a Hugging Face file), so none is drawn at random first."""
    with initialisers_skipped() if weights_follow else contextlib.nullcontext():
        return FAMILIES[cfg.family][1](cfg)


# torch.nn.init's in-place initialisers, which every family's initialisation goes through
INITIALISERS = tuple(n for n in dir(torch.nn.init) if n.endswith("_") and not n.startswith("_"))


@contextlib.contextmanager
def initialisers_skipped():
    """Inside it, torch.nn.init's initialisers leave their tensor as it is (as transformers'
    no_init_weights does): drawing random weights that reading overwrites took 3.6 of the 3.6 s of
    building SmolLM2-135M on one core. The tensors hold whatever their memory held: only for weights
    that are all read next (a loader that checks that none is missing)."""
    saved = {name: getattr(torch.nn.init, name) for name in INITIALISERS}
    for name in INITIALISERS:
        setattr(torch.nn.init, name, _left_as_it_is)
    try:
        yield
    finally:
        for name, initialiser in saved.items():
            setattr(torch.nn.init, name, initialiser)


def _left_as_it_is(tensor, *args, **kwargs):
    return tensor
