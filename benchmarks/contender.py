"""One contender of a benchmark, timed alone in this (fresh) process; prints its step times as JSON.

    python -m benchmarks.contender t5:training transformers 5 10   # module:builders name warmup steps

Run by `common.isolated`, never by hand. A process of its own per contender because in one shared
process the allocator's state, left by whichever side ran before, moved transformers' T5 step
between 1.1 s and 1.9 s while tfcli's stayed at 1.0 s: an interleaved ratio measured the history.
"""

from __future__ import annotations

import importlib
import json
import sys
import time

import torch


def build(target: str, name: str):
    """Contender `name` of `target` ("module:function" returning Contenders): its step, built."""
    module, function = target.split(":")
    return getattr(importlib.import_module(f"benchmarks.{module}"), function)()[name]()


def main(target: str, name: str, warmup: int, steps: int) -> list[float]:
    step = build(target, name)
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return times


if __name__ == "__main__":
    torch.set_num_threads(2)
    target, name, warmup, steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    print(json.dumps(main(target, name, warmup, steps)))
