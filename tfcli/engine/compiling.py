"""What runs outside torch.compile's graphs. torch.compiler.disable imports torch's compiler (more
than a second at the start of every tfcli process) where it decorates; most processes never compile (train.compile
auto is off on the CPU). `eager` marks a function now and disables it for dynamo only when a run
compiles (trainer.compiled calls keep_out_of_compiled_graphs just before torch.compile)."""

from __future__ import annotations

import functools

import torch

_SWITCHES = []  # one per eager() function: swaps in its torch.compiler.disable'd self


def eager(fn):
    """torch.compiler.disable, applied when a run first compiles."""
    chosen = [fn]  # what a call runs: fn, or fn kept out of the graph once compiling starts

    @functools.wraps(fn)
    def call(*args, **kwargs):
        return chosen[0](*args, **kwargs)

    _SWITCHES.append(lambda: chosen.__setitem__(0, torch.compiler.disable(fn)))
    return call


def keep_out_of_compiled_graphs() -> None:
    """Before torch.compile: every eager() function runs outside compiled graphs from now on."""
    for switch in _SWITCHES:
        switch()
