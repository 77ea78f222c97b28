"""Distillation's divergence in one piece against in chunks of completion tokens (issue 73): peak RSS
and seconds of one forward and backward of `tasks.distill.divergence` at a large vocabulary, each way
in a fresh process, one thread. Two heads of Qwen's vocabulary (151,936 x 64, the student's trained),
1,024 completion tokens, the JSD (beta 0.5); the figures are the divergence's own (no model body).

    python -m benchmarks distill_chunks      (BENCH_DISTILL_VOCAB, BENCH_DISTILL_TOKENS)
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time

VOCAB = int(os.environ.get("BENCH_DISTILL_VOCAB", 151_936))
TOKENS = int(os.environ.get("BENCH_DISTILL_TOKENS", 1024))
WIDTH = 64


def one(way: str) -> dict:
    """In this process: the divergence `way` ("whole" or "chunks"), twice; the second timed."""
    from types import SimpleNamespace

    import torch
    from torch import nn

    import tfcli.tasks.distill as distill

    torch.set_num_threads(1)
    torch.manual_seed(0)
    if way == "whole":
        distill.distill_rows = lambda vocab: TOKENS
    heads = [nn.Module(), nn.Module()]
    for h in heads:
        h.lm_head_weight = nn.Parameter(torch.randn(VOCAB, WIDTH) * 0.02)
    heads[1].requires_grad_(False)
    student, teacher = torch.randn(TOKENS, WIDTH, requires_grad=True), torch.randn(TOKENS, WIDTH)
    cfg = SimpleNamespace(temperature=1.0, beta=0.5)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for _ in range(2):
        started = time.perf_counter()
        total, _ = distill.divergence(heads[0], heads[1], student, teacher, cfg)
        total.backward()
        seconds = time.perf_counter() - started
    rise = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    return {"way": way, "seconds": seconds, "peak_rise_mb": rise, "divergence": float(total.detach())}


def main() -> None:
    from tfcli.objectives.losses import CHUNK_ELEMENTS

    rows = max(1, CHUNK_ELEMENTS // VOCAB)
    print(f"divergence of {TOKENS} completion tokens, vocabulary {VOCAB:,}, one thread; chunks of {rows} rows")
    results = []
    for way in ("whole", "chunks"):
        out = subprocess.run([sys.executable, "-m", "benchmarks.distill_chunks", way], capture_output=True, text=True)
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
        r = results[-1]
        print(
            f"  {way:6s}: {r['seconds']:.2f} s, peak RSS rise {r['peak_rise_mb']:,.0f} MB, divergence {r['divergence']:.6f}"
        )
    whole, chunks = results
    print(
        f"  chunks / whole: memory {chunks['peak_rise_mb'] / whole['peak_rise_mb']:.2f}x, time {chunks['seconds'] / whole['seconds']:.2f}x"
    )


if __name__ == "__main__":
    if sys.argv[1:2] in (["whole"], ["chunks"]):
        print(json.dumps(one(sys.argv[1])))
    else:
        main()
