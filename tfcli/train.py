"""ONE training loop for every objective and task: AdamW, warmup + decay, accumulation,
clipping, fp32/bf16, periodic evaluation, atomic checkpoints, exact resume, DDP.

Objectives hand it a `Prepared` (batches, loss, heads); tasks hand it the same plus an
evaluation that reports the metric to keep the best checkpoint by.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from . import checkpoint
from .display import TrainDisplay
from .errors import UserError
from .evaluate import held_out_metrics
from .objectives import Prepared
from .perf import matmul_peak_flops
from .recipe import Recipe, ScheduleConfig


@dataclass
class Runtime:
    """Where this process runs and which share of the work it has."""

    device: torch.device
    rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def setup_runtime(device: str = "auto", threads: int = 0) -> Runtime:
    """Pick the device; under torchrun (WORLD_SIZE > 1) join the process group (nccl on GPU, gloo on CPU)."""
    if threads > 0:
        torch.set_num_threads(threads)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"train.device is {device!r} but no CUDA device is available")
    dev = torch.device(device)
    if dev.type == "cuda":
        dev = torch.device("cuda", local if world > 1 else (dev.index or 0))
        torch.cuda.set_device(dev)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    return Runtime(dev, rank, world)


def teardown(rt: Runtime) -> None:
    if rt.distributed and dist.is_initialized():
        dist.destroy_process_group()


class ObjectiveModule(nn.Module):
    """Model + objective heads with the loss in forward(), so DDP sees one module and one call."""

    def __init__(self, model: nn.Module, heads: nn.ModuleDict, loss_fn):
        super().__init__()
        self.model, self.heads = model, heads
        self.loss_fn = loss_fn

    def forward(self, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        return self.loss_fn(self.model, self.heads, batch)


def build_optimizer(module: nn.Module, recipe: Recipe, device: torch.device,
                    param_groups: Optional[list[dict]] = None) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices only (not biases, norms or 1-D parameters)."""
    o = recipe.optim
    if param_groups is None:
        params = [p for p in module.parameters() if p.requires_grad]
        param_groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": o.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
    return torch.optim.AdamW(param_groups, lr=o.lr, betas=o.betas, eps=o.eps, fused=True)


def lr_multiplier(step: int, sched: ScheduleConfig, total: int, base_lr: float) -> float:
    """Linear warmup to the base rate, then cosine or linear decay to min_lr (as a multiplier)."""
    if step < sched.warmup_steps:
        return (step + 1) / sched.warmup_steps
    if sched.decay == "constant" or total <= sched.warmup_steps:
        return 1.0
    progress = min(1.0, (step - sched.warmup_steps) / max(1, total - sched.warmup_steps))
    floor = sched.min_lr / base_lr if base_lr > 0 else 0.0
    shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if sched.decay == "cosine" else 1.0 - progress
    return floor + (1.0 - floor) * shape


def autocast_context(precision: str, device: torch.device):
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def to_device(batch: dict[str, Tensor], device: torch.device) -> dict[str, Tensor]:
    return {k: v.to(device, non_blocking=True) if isinstance(v, Tensor) else v for k, v in batch.items()}


def _mean_across_ranks(values: dict[str, float], rt: Runtime) -> dict[str, float]:
    if not rt.distributed or not values:
        return values
    keys = sorted(values)
    t = torch.tensor([values[k] for k in keys], dtype=torch.float64, device=rt.device)
    dist.all_reduce(t)
    return {k: float(v) / rt.world_size for k, v in zip(keys, t.tolist())}


@dataclass
class Evaluation:
    """Optional task evaluation run beside held-out loss: returns metrics; `best_key` picks the best."""

    run: Callable[[nn.Module], dict[str, float]]
    best_key: str
    higher_is_better: bool = True


def fit(model: nn.Module, prepared: Prepared, recipe: Recipe, run_dir: Path, rt: Runtime, *,
        resume_from: Optional[Path] = None, evaluation: Optional[Evaluation] = None,
        optimizer: Optional[torch.optim.Optimizer] = None, quiet: bool = False) -> dict[str, float]:
    """Train `model` on `prepared` for recipe.train.steps optimizer steps; return the final metrics."""
    tc = recipe.train
    torch.manual_seed(tc.seed)
    module = ObjectiveModule(model, prepared.heads, prepared.loss).to(rt.device)
    opt = optimizer or build_optimizer(module, recipe, rt.device)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_multiplier(s, recipe.schedule, tc.steps, recipe.optim.lr))
    start, best = 0, None
    if resume_from is not None:
        start, best = _restore(module, opt, sched, prepared, resume_from)
    ddp = nn.parallel.DistributedDataParallel(module) if rt.distributed else module
    log_path = Path(run_dir) / "metrics.jsonl"
    peak = matmul_peak_flops(rt.device, torch.bfloat16 if tc.precision == "bf16" else torch.float32)
    display = TrainDisplay(tc.steps, start, enabled=rt.is_main and not quiet)
    last: dict[str, float] = {}

    def log(record: dict) -> None:
        if rt.is_main:
            with open(log_path, "a") as f:
                f.write(json.dumps(record) + "\n")

    window = {"items": 0, "time": 0.0, "steps": 0, "sums": {}}
    train_start = time.perf_counter()
    with display:
        for step in range(start + 1, tc.steps + 1):
            t0 = time.perf_counter()
            module.train()
            step_sums = _train_step(ddp, module, opt, prepared, recipe, rt)
            sched.step()
            items = step_sums.pop("_items")
            if rt.device.type == "cuda":
                torch.cuda.synchronize(rt.device)
            window["time"] += time.perf_counter() - t0
            window["items"] += items * rt.world_size
            window["steps"] += 1
            for k, v in step_sums.items():
                window["sums"][k] = window["sums"].get(k, 0.0) + float(v)

            if step % tc.log_interval == 0 or step == tc.steps:
                metrics = _mean_across_ranks({k: v / window["steps"] for k, v in window["sums"].items()}, rt)
                rate = window["items"] / max(window["time"], 1e-9)
                record = {"step": step, **{k: round(v, 6) for k, v in metrics.items()},
                          "lr": opt.param_groups[0]["lr"], f"{prepared.item_name}_per_s": round(rate, 1),
                          "mfu": round(rate * prepared.flops_per_item / (peak * rt.world_size), 4),
                          "elapsed_s": round(time.perf_counter() - train_start, 2)}
                log(record)
                display.update(step, record, eta_s=(tc.steps - step) * window["time"] / window["steps"])
                last.update(metrics)
                window = {"items": 0, "time": 0.0, "steps": 0, "sums": {}}

            is_best = False
            if step % tc.eval_interval == 0 or step == tc.steps:
                val = prepared.eval_metrics(_mean_across_ranks(
                    held_out_metrics(module, prepared.val(), rt.device, tc.precision), rt))
                if evaluation is not None:
                    val.update(evaluation.run(module))
                record = {"step": step, "split": "val", **{k: round(v, 6) for k, v in val.items()}}
                log(record)
                display.note(step, "val", val)
                last.update({f"val_{k}": v for k, v in val.items()})
                if evaluation is not None and evaluation.best_key in val:
                    score = val[evaluation.best_key]
                    if best is None or (score > best if evaluation.higher_is_better else score < best):
                        best, is_best = score, True

            if step % tc.ckpt_interval == 0 or step == tc.steps or is_best:
                if rt.is_main:
                    state = {"optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                             "data": prepared.train.state_dict(), "rng": checkpoint.rng_state(), "best": best}
                    checkpoint.save(run_dir, step, module, state,
                                    {"objective": recipe.objective, "family": recipe.model.family, **last},
                                    keep=tc.keep_checkpoints, best=is_best)
                if rt.distributed:
                    dist.barrier()
    return last


def _train_step(ddp: nn.Module, module: nn.Module, opt, prepared: Prepared, recipe: Recipe,
                rt: Runtime) -> dict:
    """One optimizer step over grad_accum micro-batches; returns summed (averaged) metrics and items."""
    tc = recipe.train
    sums: dict[str, Tensor] = {}
    items = 0
    for micro in range(tc.grad_accum):
        batch = to_device(prepared.train.next_batch(), rt.device)
        items += prepared.items_per_batch(batch)
        sync = ddp.no_sync() if rt.distributed and micro < tc.grad_accum - 1 else contextlib.nullcontext()
        with sync:
            with autocast_context(tc.precision, rt.device):
                loss, metrics = ddp(batch)
            (loss / tc.grad_accum).backward()
        for k, v in metrics.items():
            sums[k] = sums.get(k, 0.0) + v.detach().float() / tc.grad_accum
    if tc.clip_grad > 0:
        norm = torch.nn.utils.clip_grad_norm_(module.parameters(), tc.clip_grad)
        sums["grad_norm"] = norm.detach().float()
    opt.step()
    opt.zero_grad(set_to_none=True)
    out = {k: float(v) for k, v in sums.items()}
    out["_items"] = items
    return out


def _restore(module: nn.Module, opt, sched, prepared: Prepared, ckpt: Path) -> tuple[int, Optional[float]]:
    """Load weights, optimizer, schedule, data position and RNG: training continues exactly."""
    module.load_state_dict(checkpoint.load_weights(ckpt))
    state = checkpoint.load_state(ckpt)
    opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["scheduler"])
    prepared.train.load_state_dict(state["data"])
    checkpoint.set_rng_state(state["rng"])
    return int(checkpoint.read_meta(ckpt)["step"]), state.get("best")
