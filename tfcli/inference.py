"""Load a trained run for inference: its resolved recipe, tokenizer and weights."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from . import checkpoint
from . import recipe as recipes
from .data.tokenizers import TOKENIZER_FILE, TextTokenizer
from .errors import UserError
from .models import build_model
from .recipe import Recipe


@dataclass
class Loaded:
    model: nn.Module
    heads: dict[str, torch.Tensor]  # objective/task head weights, by name without the "heads." prefix
    recipe: Recipe
    tokenizer: TextTokenizer | None
    checkpoint: Path


def load_run(path: Path, which: str = "latest", device: str = "cpu") -> Loaded:
    """A run directory or checkpoint directory -> model in eval mode with its tokenizer."""
    ckpt = checkpoint.find(Path(path), which)
    run = checkpoint.run_dir_of(ckpt)
    config = run / "config.yaml"
    if not config.is_file():
        raise UserError(f"{run} has no config.yaml; is it a tfcli run?")
    recipe = recipes.load_resolved(config)
    model = build_model(recipe.model)
    weights = checkpoint.load_weights(ckpt)
    own = {k[len("model."):]: v for k, v in weights.items() if k.startswith("model.")}
    missing, unexpected = model.load_state_dict(own, strict=False)
    if missing:
        raise UserError(f"{ckpt}: checkpoint lacks weights {missing[:3]}... for a {recipe.model.family} model")
    heads = {k[len("heads."):]: v for k, v in weights.items() if k.startswith("heads.")}
    tok = TextTokenizer.from_run(run) if (run / TOKENIZER_FILE).is_file() else None
    return Loaded(model.to(device).eval(), heads, recipe, tok, ckpt)
