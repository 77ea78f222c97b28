"""The machine's measured matmul peak, the denominator of MFU (model FLOPs utilisation)."""
from __future__ import annotations

import json
import os
import time

import torch

from .data.sources import cache_dir


def matmul_peak_flops(device: torch.device, dtype: torch.dtype = torch.float32) -> float:
    """Best FLOP/s of square matmuls on this device per device/threads/dtype.

    Measured briefly at every start and cached as the best seen so far: a measurement taken while
    other work shares the cores reads low, and keeping it would inflate MFU for good."""
    key = f"{device.type}:{torch.cuda.get_device_name(device) if device.type == 'cuda' else ''}:" \
          f"{torch.get_num_threads()}:{dtype}"
    path = cache_dir() / "matmul_peak.json"
    table = json.loads(path.read_text()) if path.is_file() else {}
    best = max(table.get(key, 0.0), _measure(device, dtype))
    if best != table.get(key):
        table[key] = best
        tmp = path.with_suffix(f".{os.getpid()}.tmp")  # several ranks may write at once
        tmp.write_text(json.dumps(table, indent=1))
        tmp.replace(path)
    return best


def _measure(device: torch.device, dtype: torch.dtype) -> float:
    n = 4096 if device.type == "cuda" else 1024
    g = torch.Generator(device=device).manual_seed(0)  # its own: the training RNG stream is left untouched
    a = torch.randn(n, n, device=device, dtype=dtype, generator=g)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=g)
    best = 0.0
    for _ in range(3):
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(4):
            a @ b
        _sync(device)
        best = max(best, 4 * 2 * n**3 / (time.perf_counter() - t0))
    return best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
