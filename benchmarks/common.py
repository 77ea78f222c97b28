"""Side-by-side timing: tfcli and the Hugging Face peer measured in the same run.

Each contender is timed in a fresh process of its own, as a user runs it (`isolated`): warm-up
steps first (transformers' T5 step took ~10 steps to settle), then the median step. The
processes alternate (tfcli, peer, tfcli, peer) so that a drift of the machine hits both sides; the
machines are noisy (+-25% between runs), so only same-run ratios mean anything.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch

RESULTS = Path("bench-results")
ROOT = Path(__file__).resolve().parents[1]

WARMUP = 2  # steps before timing: the first two still place the step's largest buffers (tfcli's CPU tensors
# go on transparent huge pages, which the kernel compacts for on first use: 1.2 s for Gemma's 671 MB
# embedding gradient); with one warm-up the first timed step paid it


def machine() -> dict:
    """What a figure was measured on, recorded beside it (a ratio holds for its machine, not in
    general): the CPU's model, its cores and those this process may use, the BLAS torch calls, torch's
    threads and version; the GPU where one is visible."""
    import re

    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        cpu = ""
    blas = re.search(r"BLAS_INFO=(\w+)", torch.__config__.show())
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    out = {
        "cpu": cpu or __import__("platform").processor() or "unknown",
        "cores": os.cpu_count(),
        "usable_cores": usable,
        "blas": blas.group(1) if blas else "unknown",
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(0)
    return out


def machine_line() -> str:
    m = machine()
    gpu = f", {m['gpu']}" if "gpu" in m else ""
    return (
        f"machine: {m['cpu']}, {m['cores']} cores ({m['usable_cores']} usable), BLAS {m['blas']}, "
        f"{m['threads']} torch threads, torch {m['torch']}{gpu}"
    )


Step = Callable[[], None]
Contenders = dict[str, Callable[[], Step]]  # name -> builds that contender's step (models, optimizer, batch)


def in_fresh_process(module: str, *args: str):
    """Run `python -m module args` from the checkout, in a new interpreter; its last line of output,
    read as JSON. A failure raises RuntimeError with the last line it printed."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, env=env, cwd=ROOT)
    if out.returncode:
        lines = (out.stderr or out.stdout).strip().splitlines() or ["(no output)"]
        raise RuntimeError(f"{module} {' '.join(args)}: {lines[-1][:300]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def isolated(target: str, names: list[str], *, warmup: int = 5, steps: int = 10, repeats: int = 2) -> dict[str, float]:
    """Median seconds per step of each contender of `target` ("module:function" returning
    Contenders), each timed in fresh processes of its own, alternating, `repeats` processes each."""
    times: dict[str, list[float]] = {k: [] for k in names}
    for _ in range(repeats):
        for name in names:
            times[name] += in_fresh_process("benchmarks.contender", target, name, str(warmup), str(steps))
    return {k: statistics.median(v) for k, v in times.items()}


def train_step(model_loss: Callable[[], torch.Tensor], optimizer: torch.optim.Optimizer) -> Callable[[], None]:
    """A full training step: forward, backward, AdamW update."""

    def step():
        loss = model_loss()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def report(
    name: str,
    unit: str,
    items: int,
    seconds: dict[str, float],
    ours: str = "tfcli",
    peer: str = "transformers",
    target: float = 1.2,
) -> dict:
    """Print and save items/s of each contender and the ratio ours/peer."""
    rates = {k: items / v for k, v in seconds.items()}
    ratio = rates[ours] / rates[peer]
    verdict = "meets" if ratio >= target else "MISSES"
    print(
        f"{name}: tfcli {rates[ours]:,.0f} {unit}/s, transformers {rates[peer]:,.0f} {unit}/s, "
        f"ratio {ratio:.2f}x ({verdict} the {target}x target)"
    )
    for k, v in rates.items():
        if k not in (ours, peer):
            print(f"  {k}: {v:,.1f} {unit}/s")
    result = {
        "benchmark": name,
        "unit": f"{unit}/s",
        **{k: round(v, 2) for k, v in rates.items()},
        "ratio": round(ratio, 3),
        "target": target,
        "torch_threads": torch.get_num_threads(),
        "machine": machine(),
    }
    RESULTS.mkdir(exist_ok=True)
    with open(RESULTS / "results.jsonl", "a") as f:
        f.write(json.dumps(result) + "\n")
    return result


def hf_peer(cls, model: torch.nn.Module, heads: dict | None = None):
    """transformers' `cls` carrying exactly `model`'s (and its heads') weights, made the way users
    make one: `tfcli export`'s writer, then `from_pretrained`."""
    import tempfile

    from tfcli.hf import interop as hf
    from tfcli.plugin import Backbone

    with tempfile.TemporaryDirectory() as tmp:
        hf.export(Backbone(model, None, heads=dict(heads or {})), None, Path(tmp) / "hf")
        return cls.from_pretrained(Path(tmp) / "hf")
