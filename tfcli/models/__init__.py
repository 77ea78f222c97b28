"""Model families by registry key: the recipe's `model.family` picks the config and the class."""
from __future__ import annotations

from .bert import Bert, BertConfig
from .gpt import GPT, GPTConfig
from .vit import ViT, ViTConfig
from .t5 import T5, T5Config

FAMILIES: dict[str, tuple[type, type]] = {
    "gpt": (GPTConfig, GPT),
    "vit": (ViTConfig, ViT),
    "bert": (BertConfig, Bert),
    "t5": (T5Config, T5),
}


def build_model(cfg):
    """Instantiate the model class registered for cfg.family."""
    return FAMILIES[cfg.family][1](cfg)
