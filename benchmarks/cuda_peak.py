"""Where a run's CUDA memory peak lives: the caching allocator's trace of one tfcli run, replayed to
its peak, with the blocks live there grouped by the tfcli line that allocated them. This is how the
plan's DPO remainder was found (issue 39: a pass without gradients kept every block's output).

    python -m benchmarks.cuda_peak CONFIG [none|blocks]

CONFIG is one of benchmarks/memory.py's configurations (dpo-copy, smollm2-full, ...); the second
argument is train.activation_checkpointing. The run trains 2 steps eagerly with no memory limit; the
report (the peak, the plan's figures, the largest groups) is printed and written to
bench-results/cuda-peak-CONFIG-CKPT.txt. BENCH_MEMORY_MODEL as in benchmarks/gpu_fit.py. CUDA only:
torch.cuda.memory._record_memory_history has no CPU counterpart.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

from benchmarks.common import ROOT

RESULTS = ROOT / "bench-results"


def peak(trace: list[dict]) -> tuple[int, int, list[dict]]:
    """(peak bytes, index of the allocation that reached it, the allocations live at that moment)
    of a device trace of the allocator (events with action alloc / free_completed, addr, size)."""
    live, current, best, best_index = {}, 0, 0, -1
    for i, event in enumerate(trace):
        if event["action"] == "alloc":
            live[event["addr"]] = event
            current += event["size"]
            if current > best:
                best, best_index = current, i
        elif event["action"] == "free_completed" and event["addr"] in live:
            current -= live.pop(event["addr"])["size"]
    live = {}
    for event in trace[: best_index + 1]:  # replayed again up to the peak: what was live there
        if event["action"] == "alloc":
            live[event["addr"]] = event
        elif event["action"] == "free_completed":
            live.pop(event["addr"], None)
    return best, best_index, list(live.values())


def where(event: dict, depth: int = 4) -> str:
    """The innermost tfcli (or benchmarks) frames that made an allocation, innermost first."""
    frames = [f for f in event.get("frames", []) if "tfcli" in f["filename"] or "benchmarks" in f["filename"]]
    return " < ".join(f"{Path(f['filename']).name}:{f['line']}:{f['name']}" for f in frames[:depth]) or "?"


def grouped(live: list[dict], key: Callable[[dict], str] = where) -> list[tuple[str, int, int]]:
    """(key, bytes, blocks) of the live allocations by where they were made, the largest first."""
    groups = defaultdict(lambda: [0, 0])
    for event in live:
        group = groups[key(event)]
        group[0] += event["size"]
        group[1] += 1
    return sorted(((k, size, n) for k, (size, n) in groups.items()), key=lambda row: -row[1])


def main(config: str, checkpointing: str = "none") -> str:
    import torch

    from benchmarks import memory
    from benchmarks.gpu_fit import with_weights

    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.cuda_peak needs a CUDA device (the allocator's trace is CUDA's)")
    if os.environ.get("BENCH_MEMORY_MODEL"):
        with_weights(Path(os.environ["BENCH_MEMORY_MODEL"]))
    tmp = Path(tempfile.mkdtemp())
    args = [*memory.configurations(tmp)[config], *memory._pairs(memory.COMMON, False)]
    args += ["--set", f"train.activation_checkpointing={checkpointing}", "--set", "train.memory_limit=0"]
    args += ["--set", "train.compile=off", "--steps", "2", "--out", str(tmp / "run"), "--quiet"]
    torch.cuda.memory._record_memory_history(max_entries=400_000, stacks="python")
    from tfcli.cli import main as tfcli

    sys.argv = ["tfcli", *args]
    try:
        tfcli()
    except SystemExit as e:
        if e.code:
            raise
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    plan = json.loads((tmp / "run" / "run.json").read_text())["memory_plan"]
    trace = snapshot["device_traces"][torch.cuda.current_device()]
    best, index, live = peak(trace)
    lines = [
        f"{config}, activation_checkpointing {checkpointing}: peak {best / 2**30:.3f} GB at event {index} of "
        f"{len(trace)}; max_memory_allocated {torch.cuda.max_memory_allocated() / 2**30:.3f} GB; plan {json.dumps(plan)}",
        f"the allocation that reached it: {trace[index]['size'] / 2**20:.1f} MB at {where(trace[index], 8)}",
    ]
    lines += [f"{size / 2**20:10.1f} MB {n:5d} blocks  {k}" for k, size, n in grouped(live)[:40]]
    text = "\n".join(lines)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"cuda-peak-{config}-{checkpointing}.txt").write_text(text + "\n")
    print(text)
    return text


if __name__ == "__main__":
    main(*sys.argv[1:3])
