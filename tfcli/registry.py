"""Plug-ins by registry key: the objectives of `tfcli pretrain --objective KEY` and the tasks of
`tfcli finetune KEY`. A new objective or task is one file, one recipe and one line here.

Values are "module:Class" inside tfcli.objectives / tfcli.tasks, imported on first use, so that
reading a recipe does not import every plug-in.
"""

from __future__ import annotations

import importlib

from .errors import UserError

OBJECTIVES = {
    "clm": "next_token:NextToken",
    "mlm": "mlm_nsp:MaskedLM",
    "span": "span_corruption:SpanCorruption",
    "mae": "mae:MaskedAutoencoder",
    "electra": "electra:Electra",
    "igpt": "igpt:ImageGPT",
}

TASKS = {
    "classify": "classify:Classify",
    "image-classify": "image_classification:ImageClassify",
    "sft": "sft:SFT",
    "dpo": "dpo:DPO",
    "rm": "reward_model:RewardModel",
    "kto": "kto:KTO",
    "distill": "distill:Distill",
    "grpo": "grpo:GRPO",
}

_PACKAGES = {"objective": ("tfcli.objectives", OBJECTIVES), "task": ("tfcli.tasks", TASKS)}


def known(kind: str) -> list[str]:
    return sorted(_PACKAGES[kind][1])


def plugin_class(kind: str, key: str):
    """The plug-in class registered as `key`, or a UserError listing the known keys."""
    package, table = _PACKAGES[kind]
    if key not in table:
        raise UserError(f"unknown {kind} {key!r} (known: {', '.join(sorted(table))})")
    module, cls = table[key].split(":")
    return getattr(importlib.import_module(f"{package}.{module}"), cls)


def objective_for(family: str) -> str:
    """The objective that pretrains `family` (clm for gpt, mlm for bert, ...): what continued pretraining
    runs by default and whose special tokens a bare model directory is read with."""
    for key in OBJECTIVES:
        if family in plugin_class("objective", key).families:
            return key
    raise UserError(f"no objective pretrains a {family!r} model")
