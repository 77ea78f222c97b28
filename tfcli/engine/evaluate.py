"""Held-out metrics of a model: the trainer's periodic evaluation and `tfcli eval` share this."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from rich.table import Table
from torch import Tensor, nn

from ..data.sampler import PaddingBatch
from .runtime import autocast_context, to_device


@torch.no_grad()
def held_out_sums(
    module: nn.Module,
    batches: Iterable[dict[str, Tensor]],
    device: torch.device,
    precision: str = "fp32",
    weight: Callable[[dict], Tensor] | None = None,
) -> tuple[dict[str, float], float]:
    """(Sums of the loss's metrics, their count) over held-out batches (module: model + heads + loss,
    train.ObjectiveModule): each batch counts once, or as many times as `weight` (Job.loss_weight)
    says it has items, so the mean is per item; a PaddingBatch runs (its forward may be a collective)
    but is not counted."""
    was_training = module.training
    module.eval()
    sums: dict[str, float] = {}
    n = 0.0
    for batch in batches:
        padding, batch = isinstance(batch, PaddingBatch), to_device(batch, device)
        with autocast_context(precision, device):
            _, metrics = module(batch)
        if padding:  # the same keys on every rank, nothing added
            sums.update({k: sums.get(k, 0.0) for k in metrics})
            continue
        w = float(weight(batch)) if weight is not None else 1.0
        for k, v in metrics.items():
            sums[k] = sums.get(k, 0.0) + float(v) * w
        n += w
    module.train(was_training)
    return sums, n


def held_out_metrics(
    module: nn.Module,
    batches: Iterable[dict[str, Tensor]],
    device: torch.device,
    precision: str = "fp32",
    weight: Callable[[dict], Tensor] | None = None,
) -> dict[str, float]:
    """Mean of the loss's metrics over held-out batches (one process)."""
    sums, n = held_out_sums(module, batches, device, precision, weight)
    return {k: v / n for k, v in sums.items()} if n else {}


def metrics_table(title: str, metrics: dict[str, float]) -> Table:
    table = Table("metric", "value", title=title)
    for k, v in metrics.items():
        table.add_row(k, f"{v:.4f}" if isinstance(v, float) else str(v))
    return table
