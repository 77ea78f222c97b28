"""Model families by registry key: the recipe's `model.family` picks the config and the class."""
from __future__ import annotations

from .gpt import GPT, GPTConfig

FAMILIES: dict[str, tuple[type, type]] = {
    "gpt": (GPTConfig, GPT),
}


def build_model(cfg):
    """Instantiate the model class registered for cfg.family."""
    return FAMILIES[cfg.family][1](cfg)
