"""Finetuning tasks by registry key (`tfcli finetune TASK`, `tfcli eval TASK`).

Each task module provides:
  DEFAULT_RECIPE                      the recipe `tfcli finetune TASK` uses when none is given
  default_recipe(from_) -> str        (optional) the same, depending on what --from names
  finetune(recipe, from_, out, quiet) -> Path   train (recipe.task says how) and return the run dir
  evaluate(checkpoint, options) -> None          print the task's metrics (options: EvalOptions)
A task that only evaluates (e.g. `mae` reconstructions) may leave finetune out.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..errors import UserError


@dataclass
class EvalOptions:
    """What `tfcli eval TASK` was asked for, beyond the checkpoint."""

    data: Optional[str] = None
    limit: int = 0  # first N rows of each split
    out: Optional[Path] = None  # where to write a picture or report
    premise: Optional[str] = None  # classify one pair instead of a split
    hypothesis: Optional[str] = None
    few_shot: int = -1  # >= 0: k-shot prompting of an un-finetuned decoder/encoder-decoder
    seed: int = 0

TASKS: dict[str, str] = {
    "mnli": "mnli",
    "mae": "mae",  # evaluation only: reconstruction loss and picture grid of an MAE run
    "image-classify": "image_classification",
}


def get(name: str):
    """The task module for `name`, or a UserError listing the known ones."""
    if name not in TASKS:
        known = ", ".join(sorted(TASKS)) or "none yet"
        raise UserError(f"unknown task {name!r} (known: {known})")
    return importlib.import_module(f"{__name__}.{TASKS[name]}")
