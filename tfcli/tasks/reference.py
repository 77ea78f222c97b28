"""The frozen reference that preference and on-policy losses measure the model against (DPO, GRPO's KL
term): `copy`, a frozen copy of the starting model (the Job's frozen models); `base`, the model itself
with its adapters switched off (LoRA, IA3: no second copy)."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import Tensor, nn

from .. import adapters
from ..engine.backbone import base_model
from ..errors import UserError


def reference_mode(recipe) -> str:
    """<task>.reference, with auto resolved: the adapter-free base where there are adapters."""
    mode, train = recipe.settings.reference, recipe.finetune.train
    switchable = adapters.method(train).switchable
    if mode == "auto":
        return "base" if switchable else "copy"
    if mode == "base" and not switchable:
        raise UserError(
            f"{recipe.plugin}.reference base is the model with its adapters switched off; --train {train} changes "
            f"the base weights themselves (use copy, or --train lora)"
        )
    return mode


def starting_model(run_dir, recipe, backbone) -> nn.Module:
    """A frozen copy of the model training starts from (reference copy). A resumed run's model holds
    fresh weights until its checkpoint is loaded, so its --from model is read again."""
    model = base_model(run_dir, recipe) if backbone.resumed else copy.deepcopy(backbone.model)
    return model.requires_grad_(False)


@torch.no_grad()
def reference_of(model: nn.Module, mode: str, frozen: dict, fn: Callable[[nn.Module], Tensor]) -> Tensor:
    """fn(reference): of the model with its adapters off (base), or of the Job's frozen copy (copy),
    which the trainer has put on the device and wrapped."""
    if mode == "base":
        with adapters.disabled(model):
            return fn(model)
    return fn(frozen["reference"])
