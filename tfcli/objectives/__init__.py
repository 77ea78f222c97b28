"""Pretraining objectives by registry key (`--objective`, or `objective:` in a recipe).

Each objective module provides:
  FAMILY            the model family it trains ("gpt", "bert", "t5", "vit")
  DEFAULT_RECIPE    the recipe `tfcli pretrain --objective X` uses when none is given
  SPECIAL_TOKENS    what its tokenizer must have (text objectives)
  TEXT              optional, default True; False: no documents or tokenizer (MAE loads its own images)
  prepare(recipe, tokenizer, runtime) -> Prepared    data, heads and loss for the trainer
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Protocol

from torch import Tensor, nn

from ..errors import UserError

OBJECTIVES = {
    "clm": "next_token",
    "span": "span_corruption",
    "mae": "mae",
    "mlm": "mlm_nsp",
}


class BatchSource(Protocol):
    """A resumable stream of training batches."""

    def next_batch(self) -> dict[str, Tensor]: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...


LossFn = Callable[[nn.Module, nn.ModuleDict, dict[str, Tensor]], tuple[Tensor, dict[str, Tensor]]]


@dataclass
class Prepared:
    """Everything the trainer needs from an objective."""

    train: BatchSource
    val: Callable[[], Iterable[dict[str, Tensor]]]  # a fresh pass over the same held-out batches
    loss: LossFn  # (model, heads, batch) -> (loss, metrics of scalar tensors)
    items_per_batch: Callable[[dict[str, Tensor]], int]  # tokens (or images) a batch counts for
    flops_per_item: float  # training FLOPs per token/image, for MFU
    heads: nn.ModuleDict = field(default_factory=nn.ModuleDict)
    eval_metrics: Callable[[dict[str, float]], dict[str, float]] = lambda m: m  # e.g. add perplexity
    item_name: str = "tok"
    # run directory -> a train.Evaluation run at each evaluation (e.g. MAE saves reconstruction pictures)
    evaluation: Optional[Callable[[Path], Any]] = None


def get(name: str):
    """The objective module for `name`, or a UserError listing the known ones."""
    if name not in OBJECTIVES:
        raise UserError(f"unknown objective {name!r} (known: {', '.join(sorted(OBJECTIVES))})")
    return importlib.import_module(f"{__name__}.{OBJECTIVES[name]}")
