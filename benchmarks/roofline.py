"""Where a step's time goes, both sides: the share of matrix products (the work both contenders must
do at the same shapes, precision and threads) against everything else, and from it the highest ratio
tfcli could reach over the peer by removing everything that is not a matrix product.

Each contender of a benchmark's step is built in a fresh process of its own (as `isolated` times
them), warmed up, then one step is profiled by torch.profiler on the CPU. A "matrix product" is any
of the BLAS-backed operators below, counted by self time (so a linear's backward counts its
products, not its bookkeeping). The bound: the peer's step time over the time the peer spends in
matrix products; and tighter, over its products and fused attention (SDPA: the same kernel on both
sides). tfcli runs the same products (same shapes, same library), so no implementation of the same
computation can beat the peer by more than that; a target above the bound needs less arithmetic (or
faster arithmetic: lower precision), which the benchmarks' like-for-like settings rule out. The shares
come from the profiled step, the seconds from the faster of two unprofiled steps after two warm-ups.

    python -m benchmarks roofline                                   # the issue-59/60 speed targets (6 min)
    BENCH_ROOFLINE=families:gemma3_full python -m benchmarks roofline
    BENCH_ROOFLINE_VOCAB=262144 ...   # and the output layer's products by shape (a vocabulary of 262,144)
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import defaultdict

import torch

from benchmarks.common import RESULTS, WARMUP, in_fresh_process, machine, machine_line

PRODUCTS = frozenset(
    {
        "aten::mm",
        "aten::addmm",
        "aten::addmm_",
        "aten::bmm",
        "aten::baddbmm",
        "aten::baddbmm_",
        "aten::addbmm",
        "aten::mv",
        "aten::addmv",
        "aten::dot",
        "aten::_grouped_mm",
    }
)
ATTENTION = frozenset(
    {
        "aten::_scaled_dot_product_flash_attention_for_cpu",
        "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
    }
)
TARGETS = {  # benchmark step -> its target ratio (issue 59: 1.3x, issue 60: 1.5x)
    "families:gemma3_full": 1.3,
    "families:gemma3_lora": 1.3,
    "families:phi3_full": 1.3,
    "families:phi3_lora": 1.3,
    "families:modernbert_mnli": 1.3,
    "moe:full": 1.5,
    "moe:lora": 1.5,
    "moe:decode": 1.5,
}


def profile(target: str, name: str, warmup: int = WARMUP) -> dict:
    """One step of contender `name` of `target` under the profiler: seconds in all, in matrix products,
    in fused attention, and the five costliest other operators."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    from benchmarks.contender import build

    step = build(target, name)
    for _ in range(warmup):
        step()
    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    plain = min(times)
    with profiler(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        t0 = time.perf_counter()
        step()
        profiled = time.perf_counter() - t0
    self_us: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        self_us[event.key] += event.self_cpu_time_total
    head = output_layer_products(prof, int(os.environ.get("BENCH_ROOFLINE_VOCAB", "0")))
    products = sum(v for k, v in self_us.items() if k in PRODUCTS) / 1e6
    attention = sum(v for k, v in self_us.items() if k in ATTENTION) / 1e6
    profiled_total = sum(self_us.values()) / 1e6
    others = sorted(((v / 1e6, k) for k, v in self_us.items() if k not in PRODUCTS | ATTENTION), reverse=True)[:5]
    # the profiler's own cost inflates small operators: scale its shares onto the unprofiled step
    return {
        "seconds": plain,
        "profiled_seconds": profiled,
        "product_share": products / profiled_total,
        "attention_share": attention / profiled_total,
        "products_s": products * plain / profiled,
        "attention_s": attention * plain / profiled,
        "others": [(k, round(v, 3)) for v, k in others],
        "output_layer": [(shapes, round(v * plain / profiled, 3)) for shapes, v in head],
    }


def output_layer_products(prof, vocab: int) -> list[tuple[str, float]]:
    """The matrix products of the output layer by input shapes (seconds, the profiled step's): those
    with the vocabulary among their dimensions, or a tile of it (tfcli's loss over the vocabulary in
    tiles of losses._tile's columns). Empty without BENCH_ROOFLINE_VOCAB."""
    if not vocab:
        return []
    from tfcli.objectives import losses

    widths = {vocab} | {losses._tile(rows, vocab)[1] for rows in (128, 256, 512, 1024, 2048, 4096)}
    out = []
    for event in prof.key_averages(group_by_input_shape=True):
        dims = {d for shape in event.input_shapes or [] for d in shape}
        if event.key in PRODUCTS and dims & widths:
            out.append((f"{event.count} x {event.key} {event.input_shapes}", event.self_cpu_time_total / 1e6))
    return sorted(out, key=lambda x: -x[1])


def main() -> None:
    torch.set_num_threads(2)
    print(machine_line())
    targets = os.environ.get("BENCH_ROOFLINE", ",".join(TARGETS)).split(",")
    for target in targets:
        if target.startswith("moe:"):
            from benchmarks import moe

            moe.directory()
        if target.startswith("families:"):
            from benchmarks import families

            families.directory(target.split(":")[1].rsplit("_", 1)[0])
        sides = {
            name: in_fresh_process("benchmarks.roofline", "--one", target, name) for name in ("tfcli", "transformers")
        }
        ours, peer = sides["tfcli"], sides["transformers"]
        bound = peer["seconds"] / peer["products_s"]
        with_attention = peer["seconds"] / (peer["products_s"] + peer["attention_s"])
        ratio = peer["seconds"] / ours["seconds"]
        print(
            f"{target}: tfcli {ours['seconds']:.2f} s a step ({ours['product_share']:.0%} matrix products, "
            f"{ours['attention_share']:.0%} attention), transformers {peer['seconds']:.2f} s "
            f"({peer['product_share']:.0%} products, {peer['attention_share']:.0%} attention); ratio {ratio:.2f}x; "
            f"bound {bound:.2f}x at the peer's products, {with_attention:.2f}x with its attention "
            f"(target {TARGETS.get(target, '-')}x)"
        )
        for side, result in sides.items():
            print(f"  {side} costliest others: " + ", ".join(f"{k} {v:.2f}s" for k, v in result["others"]))
            for shapes, seconds in result["output_layer"]:
                print(f"  {side} output layer: {seconds:.2f}s {shapes}")
        RESULTS.mkdir(exist_ok=True)
        with open(RESULTS / "results.jsonl", "a") as f:
            record = {
                "benchmark": f"roofline {target}",
                "ratio": round(ratio, 3),
                "bound": round(bound, 3),
                "bound_with_attention": round(with_attention, 3),
                "machine": machine(),
            }
            f.write(json.dumps({**record, "tfcli": ours, "transformers": peer}) + "\n")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--one"]:
        torch.set_num_threads(2)
        print(json.dumps(profile(sys.argv[2], sys.argv[3])))
    else:
        main()
