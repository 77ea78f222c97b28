"""The denominator of MFU (model FLOPs utilisation): the device's peak matmul FLOP/s for a dtype.

GPUs: the dense peak from a table of known accelerators (the vendors' datasheet figures, without
sparsity); others are measured. CPUs: measured once per CPU model, thread count and dtype, as the
best of several timed rounds at two sizes (another program on the cores only ever makes a round
slower, so the best round is the machine's), and cached. The peak is never below what a run
achieves: MFU is at most 100%.

What MFU counts: the training FLOPs of the model's matrix products per item (each model kind gives
its own count, `flops_per_token` in models/kinds.py: 6 x matmul parameters per token, forward 2 and
backward 4, plus attention's 12 x layers x sequence x width; forward only, 2 x, through a frozen
backbone, 4 x through one with adapters: training_flops_multiplier), times items per second, over
this peak x processes.
"""

from __future__ import annotations

import json
import time

import torch

from ..data.sources import cache_dir, write_into_place

# dense TFLOP/s by (GPU name fragment, dtype); the first fragment that the device's name contains wins
GPU_PEAKS = [
    ("H200", {"bf16": 989.4, "fp32": 66.9}),
    ("H100 PCIe", {"bf16": 756.5, "fp32": 51.2}),
    ("H100", {"bf16": 989.4, "fp32": 66.9}),
    ("A100", {"bf16": 312.0, "fp32": 19.5}),
    ("L40S", {"bf16": 362.1, "fp32": 91.6}),
    ("L4", {"bf16": 121.0, "fp32": 30.3}),
    ("A10G", {"bf16": 70.0, "fp32": 35.0}),
    ("A10", {"bf16": 125.0, "fp32": 31.2}),
    ("RTX 4090", {"bf16": 165.2, "fp32": 82.6}),
    ("RTX 3090", {"bf16": 71.0, "fp32": 35.6}),
    ("V100", {"bf16": 125.0, "fp32": 15.7}),
    ("T4", {"bf16": 65.0, "fp32": 8.1}),
]


def _dtype_name(dtype: torch.dtype) -> str:
    return "bf16" if dtype in (torch.bfloat16, torch.float16) else "fp32"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "cpu")
    except OSError:
        return "cpu"


def matmul_peak_flops(device: torch.device, dtype: torch.dtype = torch.float32) -> float:
    """Peak FLOP/s of `device` in `dtype`: a known accelerator's datasheet figure, else measured (cached)."""
    name = device_name(device)
    if device.type == "cuda":
        for fragment, peaks in GPU_PEAKS:
            if fragment in name:
                return peaks[_dtype_name(dtype)] * 1e12
    key = f"{device.type}:{name}:{torch.get_num_threads()}:{_dtype_name(dtype)}"
    path = cache_dir() / "matmul_peak.json"
    table = json.loads(path.read_text()) if path.is_file() else {}
    if key not in table:
        table[key] = _measure(device, dtype)
        write_into_place(path, lambda tmp: tmp.write_text(json.dumps(table, indent=1)))  # ranks may write at once
    return table[key]


def training_flops_multiplier(train: str) -> float:
    """FLOPs per parameter and token of one training step by what trains (finetune.train): 6 when
    every weight learns (forward 2, input gradients 2, weight gradients 2); 4 when the weights are
    frozen but gradients flow back through them (lora, ia3, bitfit: their own parameters are few);
    2 when only a head on top learns (the backbone runs forward only): the method's own record."""
    from ..adapters import method

    return method(train).flops


def mfu(achieved_flops: float, peak: float) -> float | None:
    """Achieved over peak; None (shown as n/a) where that is above 1: the FLOP count or the measured
    peak is wrong, and a pinned 100% would hide it."""
    if peak <= 0:
        return None
    ratio = achieved_flops / peak
    return ratio if ratio <= 1.0 else None


def _measure(device: torch.device, dtype: torch.dtype) -> float:
    sizes = (4096, 8192) if device.type == "cuda" else (1024, 2048)
    g = torch.Generator(device=device).manual_seed(0)  # its own: the training RNG stream is left untouched
    best = 0.0
    for n in sizes:
        a = torch.randn(n, n, device=device, dtype=dtype, generator=g)
        b = torch.randn(n, n, device=device, dtype=dtype, generator=g)
        a @ b  # warm up
        for _ in range(5):
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(3):
                a @ b
            _sync(device)
            best = max(best, 3 * 2 * n**3 / (time.perf_counter() - t0))
    return best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory_mb(device: torch.device) -> float:
    """The most memory this process has held: allocated CUDA memory on a GPU, resident set size on a
    CPU (the whole process: weights, gradients, optimizer state, activations, data)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return peak_resident_bytes() / 2**20


def peak_resident_bytes() -> float:
    """This process's own peak resident memory: Linux's VmHWM, which starts again at exec. getrusage's
    ru_maxrss does not: it keeps the peak of the process that started this one (a compare cell, a
    torchrun worker), so it is only the fallback where /proc is absent."""
    own = proc_bytes("/proc/self/status", "VmHWM:")
    if own is not None:
        return own
    import resource
    import sys

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return float(rss if sys.platform == "darwin" else rss * 1024)  # bytes on macOS, KiB on Linux


def proc_bytes(path: str, key: str) -> float | None:
    """A 'Key:  N kB' line of a Linux /proc file, in bytes (None elsewhere)."""
    try:
        for line in open(path):
            if line.startswith(key):
                return float(line.split()[1]) * 1024
    except OSError:
        pass
    return None
