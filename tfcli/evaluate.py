"""Held-out metrics of a model: the trainer's periodic evaluation and `tfcli eval` share this."""
from __future__ import annotations

from typing import Iterable

import torch
from torch import Tensor, nn


@torch.no_grad()
def held_out_metrics(module: nn.Module, batches: Iterable[dict[str, Tensor]], device: torch.device,
                     precision: str = "fp32") -> dict[str, float]:
    """Mean of the objective's metrics over held-out batches (module: model + heads + loss)."""
    from .train import autocast_context, to_device

    was_training = module.training
    module.eval()
    sums: dict[str, float] = {}
    n = 0
    for batch in batches:
        with autocast_context(precision, device):
            _, metrics = module(to_device(batch, device))
        for k, v in metrics.items():
            sums[k] = sums.get(k, 0.0) + float(v)
        n += 1
    module.train(was_training)
    return {k: v / n for k, v in sums.items()} if n else {}


def evaluate_pretraining(path, data: str | None = None, batches: int = 0, device: str = "cpu") -> dict[str, float]:
    """Held-out metrics of a pretraining run: its own validation split, or all of `data`."""
    from . import objectives
    from .inference import load_run
    from .pretrain import load_docs
    from .train import ObjectiveModule

    loaded = load_run(path, device=device)
    recipe = loaded.recipe
    if data:
        recipe.data.source, recipe.data.val_source = data, data
    if batches:
        recipe.train.eval_batches = batches
    objective = objectives.get(recipe.objective)
    docs = load_docs(recipe) if getattr(objective, "TEXT", True) else None  # MAE loads its own images
    prepared = objective.prepare(recipe, loaded.tokenizer, docs, loaded.model)
    prepared.heads.load_state_dict(loaded.heads)
    module = ObjectiveModule(loaded.model, prepared.heads, prepared.loss).to(device)
    metrics = held_out_metrics(module, prepared.val(), torch.device(device))
    if not metrics:
        from .errors import UserError
        raise UserError("no held-out batches to evaluate on (data shorter than one block?)")
    return prepared.eval_metrics(metrics)


def metrics_table(title: str, metrics: dict[str, float]):
    from rich.table import Table

    table = Table("metric", "value", title=title)
    for k, v in metrics.items():
        table.add_row(k, f"{v:.4f}")
    return table
