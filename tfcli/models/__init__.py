"""Model families by registry key: the recipe's `model.family` picks the config and the class."""
from __future__ import annotations

from .bert import Bert, BertConfig
from .gpt import GPT, GPTConfig
from .t5 import T5, T5Config
from .vit import ViT, ViTConfig

TEXT_FAMILIES = ("gpt", "bert", "t5")  # families that read text (and so have a tokenizer)

FAMILIES: dict[str, tuple[type, type]] = {
    "gpt": (GPTConfig, GPT),
    "t5": (T5Config, T5),
    "bert": (BertConfig, Bert),
    "vit": (ViTConfig, ViT),
}


def transformer_blocks(module) -> list:
    """Every transformer block inside `module` (a model, or a model with heads): what FSDP shards one
    by one and activation checkpointing recomputes."""
    from .blocks import Block

    return [m for m in module.modules() if isinstance(m, Block)]


def build_model(cfg):
    """Instantiate the model class registered for cfg.family."""
    return FAMILIES[cfg.family][1](cfg)
