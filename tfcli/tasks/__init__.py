"""Finetuning tasks by registry key (`tfcli finetune TASK`, `tfcli eval TASK`)."""
from __future__ import annotations

import importlib

from ..errors import UserError

TASKS: dict[str, str] = {}


def get(name: str):
    """The task module for `name`, or a UserError listing the known ones."""
    if name not in TASKS:
        known = ", ".join(sorted(TASKS)) or "none yet"
        raise UserError(f"unknown task {name!r} (known: {known})")
    return importlib.import_module(f"{__name__}.{TASKS[name]}")
