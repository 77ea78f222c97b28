"""ONE training loop for every objective and task: AdamW, warmup + decay, accumulation, clipping,
fp32/bf16, periodic evaluation, atomic checkpoints, exact resume, and whatever distribution
strategy the runtime carries (it wraps, syncs, clips and gathers state; the loop never names DDP).
"""

from __future__ import annotations

import contextlib
import json
import math
import signal
import threading
import time
from pathlib import Path

import torch
from torch import Tensor, nn

from ..data.sampler import StreamSampler, make_sampler, micro_slices, sequential_batches
from ..display import TrainDisplay, phase
from ..errors import Interrupted, UserError
from ..models import moe
from ..plugin import Batch, Job, LossFn
from . import checkpoint, optimizers, plots, shards
from .compiling import keep_out_of_compiled_graphs
from .evaluate import held_out_sums
from .loggers import MetricsLog, check_available
from .perf import matmul_peak_flops, mfu, peak_memory_mb
from .prefetch import Prefetcher
from .runtime import Runtime, abort_on_collective_failure, autocast_context, to_device


class ObjectiveModule(nn.Module):
    """Model + plug-in heads behind one forward, so a strategy wraps one module: forward(batch)
    is the training loss (with a mixture of experts' routing losses, whatever the task); forward(batch,
    fn) runs any fn(model, heads, batch), e.g. a prediction."""

    def __init__(self, model: nn.Module, heads: nn.ModuleDict, loss_fn: LossFn):
        super().__init__()
        self.model, self.heads = model, heads
        self.loss_fn = loss_fn
        # the model's MoE layers (adapters are in place before this module is made), found here and not
        # at the first pass: state a compiled pass sets fails the graph's guard and compiles it again
        self._routers = moe.moe_layers(model)

    def forward(self, batch: Batch, fn: LossFn | None = None):
        if fn is not None:
            return fn(self.model, self.heads, batch)
        routers = self._routers
        moe.routing_losses(routers)  # forget what an earlier pass (a recomputation) kept
        loss, metrics = self.loss_fn(self.model, self.heads, batch)
        extra, routed = moe.routing_losses(routers)
        if extra is None:
            return loss, metrics
        return loss + extra, {**metrics, **routed}


def prepare_frozen(frozen: dict[str, nn.Module], rt) -> None:
    """Job.frozen in place: on the run's device, eval mode (no dropout), no gradients, wrapped by the
    strategy for inference. They stay outside the ObjectiveModule, so no optimizer or checkpoint sees them."""
    for name, model in frozen.items():
        model.to(rt.device).eval().requires_grad_(False)
        frozen[name] = rt.strategy.wrap_frozen(model)


def decay_groups(module: nn.Module, weight_decay: float, lr: float) -> list[dict]:
    """Trainable parameters of `module` in two AdamW groups: matrices decay, biases/norms/1-D do not."""
    params = [p for p in module.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay, "lr": lr},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0, "lr": lr},
    ]


def build_optimizer(module: ObjectiveModule, recipe, head_lr: float = 0.0) -> torch.optim.Optimizer:
    """AdamW (optim.name: fused, or torchao's 8/4-bit) over what trains (adapters.apply froze the rest),
    weight decay on matrices only; a task's head at its own rate (Job.head_lr; 0: optim.lr)."""
    o = recipe.optim
    head_lr = head_lr or o.lr
    groups = decay_groups(module.heads, o.weight_decay, head_lr) + decay_groups(module.model, o.weight_decay, o.lr)
    return optimizers.build([g for g in groups if g["params"]], o)


def compiled(module: nn.Module, setting: str, device: torch.device):
    """train.compile: torch.compile of the model and its loss (auto: on CUDA only; on the CPU it has
    not paid for itself in tfcli's benchmarks)."""
    if setting == "off" or (setting == "auto" and device.type != "cuda"):
        return module
    keep_out_of_compiled_graphs()
    return torch.compile(module)


def set_checkpointing(module: nn.Module, on: bool) -> None:
    """train.activation_checkpointing: every transformer block keeps only its input for the backward
    pass and recomputes the rest (less memory, about a third more compute)."""
    from ..models import transformer_blocks

    for block in transformer_blocks(module):
        block.checkpointing = on


def lr_multiplier(step: int, sched, total: int, base_lr: float) -> float:
    """Linear warmup to the base rate, then cosine or linear decay to min_lr (as a multiplier)."""
    if step < sched.warmup_steps:
        return (step + 1) / sched.warmup_steps
    if sched.decay == "constant" or total <= sched.warmup_steps:
        return 1.0
    progress = min(1.0, (step - sched.warmup_steps) / max(1, total - sched.warmup_steps))
    floor = sched.min_lr / base_lr if base_lr > 0 else 0.0
    shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if sched.decay == "cosine" else 1.0 - progress
    return floor + (1.0 - floor) * shape


class Trainer:
    """The state of one run's training: module, optimizer, schedule, data position, best score."""

    def __init__(
        self,
        module: ObjectiveModule,
        job: Job,
        recipe,
        run_dir: Path,
        rt: Runtime,
        quiet: bool = False,
        partial: bool = False,
    ):
        self.module, self.job, self.recipe, self.run_dir, self.rt = module.to(rt.device), job, recipe, Path(run_dir), rt
        self.tc = recipe.train
        # the driver resolved auto (the memory plan's choice) before the trainer was built
        set_checkpointing(module, self.tc.activation_checkpointing == "blocks")
        # wrapped before the optimizer is built: FSDP replaces the parameters with their shards
        self.wrapped = rt.strategy.wrap(module, self.tc.precision)
        prepare_frozen(job.frozen, rt)
        if recipe.optim.name != "adamw" and rt.strategy.sharded:
            optimizers.for_unequal_shares(module, rt.world_size)
        self.opt = build_optimizer(module, recipe, job.head_lr)
        self.forward = compiled(self.wrapped, self.tc.compile, rt.device)
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, lambda s: lr_multiplier(s, recipe.schedule, self.tc.steps, recipe.optim.lr)
        )
        self.sampler, self.batches = self._data(job, rt)
        self.micro_batches = self.tc.grad_accum * len(micro_slices(self.tc.batch_size, self.tc.micro_batch_size))
        self.step, self.best, self.skipped = 0, None, 0
        self.rollouts: tuple[list, dict] | None = None  # on-policy batches and metrics, for job.online.reuse steps
        self.elapsed_before, self.started = (
            0.0,
            time.perf_counter(),
        )  # wall seconds of earlier sessions, this one's start
        self.quiet, self.partial = quiet, partial
        # a partial run saves what trains and the heads; its base is read again on load
        self.saved = (
            {f"{n}" for n, p in module.named_parameters() if p.requires_grad or n.startswith("heads.")}
            if partial
            else None
        )
        self.last: dict[str, float] = {}
        self.window = _Window()  # the steps since the last log line (a checkpoint keeps them: see restore)
        self.doing = "setup"  # what the loop is doing, for an error that stops it (e.g. a collective timeout)
        check_available(self.tc.loggers)
        self.log = MetricsLog(self.run_dir, self.tc.loggers, recipe.name) if rt.is_main else None

    def _data(self, job: Job, rt: Runtime):
        """The training data's sampler, and what the loop reads it through: batches built ahead in a
        thread (not for streams: their position is the whole shuffle buffer)."""
        t = self.tc
        sampler = make_sampler(job.train, t.batch_size, t.seed, rt.rank, rt.world_size, t.micro_batch_size)
        if t.prefetch > 0 and not isinstance(sampler, StreamSampler):
            return sampler, Prefetcher(sampler, t.prefetch, rt.device.type == "cuda")
        return sampler, sampler

    def restore(self, ckpt: Path) -> None:
        """Weights, optimizer, schedule, data position and RNG: training continues exactly. A checkpoint
        that does not fit this run's model is refused before anything is written. An FSDP run's shards
        load on any number of processes (torch.distributed.checkpoint reshards them)."""
        checkpoint.verify(ckpt)
        sharded = shards.is_sharded(ckpt)
        weights = None if sharded else checkpoint.load_weights(ckpt)
        saved = shards.sizes(ckpt) if sharded else {k: tuple(v.shape) for k, v in weights.items()}
        self._check_fits(ckpt, {k: v for k, v in saved.items() if not k.startswith(shards.OPTIM)})
        state = checkpoint.load_state(ckpt)
        if sharded:
            shards.load(ckpt, self.module, self.opt, state["optimizer"]["param_groups"], self.saved)
        else:
            # a partial run's base weights are in place already: only what it trained is loaded
            self.rt.strategy.load_state_dict(self.module, weights, strict=self.saved is None)
            optimizer = optimizers.rebuilt(state["optimizer"])
            self.rt.strategy.load_optimizer_state_dict(self.module, self.opt, optimizer)
        self.sched.load_state_dict(state["scheduler"])
        self.batches.load_state_dict(state["data"])
        checkpoint.set_rng_state(state["rng"])
        self.step, self.best = int(checkpoint.read_meta(ckpt)["step"]), state.get("best")
        self.elapsed_before = float(state.get("elapsed_s", 0.0))
        self.skipped = int(state.get("skipped", 0))
        self.window = _Window.from_state(state.get("window"))  # the first log line covers its whole interval
        if state.get("rollouts") is not None:  # saved between two steps that train on the same rollouts
            batches, sampled = state["rollouts"]
            self.rollouts = [to_device(b, self.rt.device) for b in batches], to_device(sampled, self.rt.device)

    def _check_fits(self, ckpt: Path, saved: dict[str, tuple]) -> None:
        """Refuse a checkpoint whose weights are not this run's model's (names and whole shapes)."""
        mine = {k: tuple(v.shape) for k, v in self.module.state_dict().items() if self.saved is None or k in self.saved}
        wrong = [k for k in mine if saved.get(k) != mine[k]] + [k for k in saved if k not in mine]
        if wrong:
            k = wrong[0]
            raise UserError(
                f"{ckpt} does not fit this run's model: {k} is {saved.get(k, 'none')} in the checkpoint, "
                f"{mine.get(k, 'absent')} in the model (was the recipe's model changed?)"
            )

    def forget_after(self, step: int) -> None:
        """Drop metrics a run logged after the checkpoint it is resumed from (it will log them again)."""
        log = self.run_dir / "metrics.jsonl"
        if self.rt.is_main and log.is_file():
            keep = [line for line in log.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step]
            log.write_text("".join(line + "\n" for line in keep))

    def fit(self) -> dict[str, float]:
        """Train to train.steps; log, evaluate and checkpoint on their intervals; return the last metrics.
        A collective that times out (ranks that disagree) ends the process in one line (runtime)."""
        try:
            return self._fit()
        except Exception as e:
            abort_on_collective_failure(self.rt, self.doing, e)
            raise

    def _fit(self) -> dict[str, float]:
        if self.step == 0:  # a resumed run has its RNG state from the checkpoint
            torch.manual_seed(self.tc.seed)
        self.started = time.perf_counter()
        peak = matmul_peak_flops(self.rt.device, torch.bfloat16 if self.tc.precision == "bf16" else torch.float32)
        window = self.window
        with (
            TrainDisplay(self.tc.steps, self.step, enabled=self.rt.is_main and not self.quiet) as display,
            _StopOnSignal() as stop,
            contextlib.closing(self),
        ):
            while self.step < self.tc.steps:
                if self._agreed(stop.requested):
                    self._save(False)
                    raise Interrupted(self.step, self.run_dir)
                window.begin()
                self.doing = f"training step {self.step + 1}"
                metrics, items = self._train_step()
                self.step += 1
                window.add(self.step, metrics, items * self.rt.world_size)
                display.step(self.step, metrics if window.steps == 1 else None)
                if self.step % self.tc.log_interval == 0 or self.step == self.tc.steps:
                    self._log(window, peak, display)
                    window = self.window = _Window()
                out_of_time = self._agreed(self.tc.max_time > 0 and self.elapsed() >= 60 * self.tc.max_time)
                if out_of_time and window.steps:
                    self._log(window, peak, display)
                    window = self.window = _Window()
                with window.excluding():  # evaluation and checkpoints are not training throughput
                    is_best = self._evaluate(display) if self._due(self.tc.eval_interval) or out_of_time else False
                    if self._due(self.tc.ckpt_interval) or is_best or out_of_time:
                        self._save(is_best)
                if out_of_time:
                    self._write(
                        {"step": self.step, "split": "stopped", "reason": f"train.max_time {self.tc.max_time:g} min"}
                    )
                    display.note(self.step, "stopped", {"max_time_min": self.tc.max_time})
                    break
        return self.last

    def elapsed(self) -> float:
        """Wall-clock seconds of training (evaluations included), continuing across resumes."""
        return self.elapsed_before + time.perf_counter() - self.started

    def _due(self, interval: int) -> bool:
        return self.step % interval == 0 or self.step == self.tc.steps

    def _agreed(self, flag: bool) -> bool:
        """Whether any rank was asked to stop (every rank stops at the same step)."""
        if not self.rt.distributed:
            return flag
        return any(v > 0 for v in self.rt.mean({"stop": float(flag)}).values())

    def _train_step(self) -> tuple[dict[str, Tensor], int]:
        """One optimizer step over grad_accum batches (each in its micro-batches) -> (its metrics, averaged over them, still on
        the device; items). Nothing is read back to the host: a step whose loss or gradient is not
        finite is skipped inside the fused optimizer (found_inf), and noticed at the next log line."""
        self.module.train()
        batches, sampled = self._step_batches()
        sums, items = self._backward(batches), sum(self.job.count_items(b) for b in batches)
        max_norm = self.tc.clip_grad if self.tc.clip_grad > 0 else float("inf")
        sums["grad_norm"] = self.rt.strategy.clip_grad_norm(self.module, max_norm).detach().float()
        found_inf = (~torch.stack(list(sums.values())).isfinite().all()).float()  # 1.0: skip this step
        optimizers.step(self.opt, found_inf)
        self.opt.zero_grad(set_to_none=True)
        self.sched.step()
        return {**sampled, **sums}, items

    def _step_batches(self) -> tuple[list[Batch], dict[str, Tensor]]:
        """The step's micro-batches as drawn, or (on-policy tasks) the rollouts made from them: sampled
        afresh every job.online.reuse steps, the same ones in between."""
        drawn = lambda: [to_device(self.batches.next_batch(), self.rt.device) for _ in range(self.micro_batches)]
        if self.job.online is None:
            return drawn(), {}
        if self.rollouts is None or self.step % self.job.online.reuse == 0:
            self.doing = f"sampling completions for step {self.step + 1}"
            with torch.no_grad():
                self.rollouts = self.job.online.rollout(self.module, drawn())
            self.doing = f"training step {self.step + 1}"
        return self.rollouts

    def _backward(self, batches: list[Batch]) -> dict[str, Tensor]:
        """Gradients of one optimizer step's micro-batches, accumulated; their metrics, averaged the
        way the loss is (still on the device)."""
        sums: dict[str, Tensor] = {}
        for micro, (batch, weight) in enumerate(zip(batches, self._micro_weights(batches))):
            with self.rt.strategy.sync_gradients(self.wrapped, micro == len(batches) - 1):
                with autocast_context(self.tc.precision, self.rt.device):
                    loss, metrics = self.forward(batch)
                (loss * weight).backward()
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + v.detach().float() * weight
        return sums

    def _micro_weights(self, batches: list[Batch]) -> list:
        """Each micro-batch's share of the step's loss: 1/grad_accum, or (Job.loss_weight) its items
        over the items of the whole global batch, times the processes (whose gradients the strategy
        averages), so that the step's gradient is the mean over every item. No value leaves the device."""
        if self.job.loss_weight is None:
            return [1.0 / len(batches)] * len(batches)
        counts = [self.job.loss_weight(b).float() for b in batches]
        total = self.rt.sum_tensor(torch.stack(counts).sum()).clamp(min=1.0)
        return [c * self.rt.world_size / total for c in counts]

    def _non_finite(self, bad: list[tuple[int, dict[str, float]]]) -> None:
        """Steps whose update was skipped for a non-finite loss or gradient: logged (train.skip_nonfinite
        of them in all), then the run stops naming the first; the weights never took such an update,
        and `latest` is the last checkpoint before it."""
        for step, metrics in bad:
            what = ", ".join(f"{k} {v}" for k, v in metrics.items() if not math.isfinite(v))
            self.skipped += 1
            if self.skipped <= self.tc.skip_nonfinite:
                self._write({"step": step, "split": "skipped", "reason": what})
                continue
            latest = checkpoint.read_pointer(self.run_dir / checkpoint.CHECKPOINTS / "latest")
            raise UserError(
                f"step {step}: {what}; stopped before updating the weights "
                f"({'latest is ' + latest if latest else 'no checkpoint was written'}; "
                f"lower the learning rate, or set train.skip_nonfinite to skip such batches)"
            )

    def _log(self, window: _Window, peak: float, display: TrainDisplay) -> None:
        """The window's metrics, read from the device once: skipped steps reported, the rest averaged."""
        steps = window.read()
        self._non_finite([(s, m) for s, m in steps if not all(math.isfinite(v) for v in m.values())])
        good = [m for _, m in steps if all(math.isfinite(v) for v in m.values())]
        metrics = self.rt.mean({k: sum(m[k] for m in good) / len(good) for k in good[0]} if good else {})
        seconds = window.seconds()
        rate = window.items / max(seconds, 1e-9)
        record = {
            "step": self.step,
            "split": "train",
            **{k: round(v, 6) for k, v in metrics.items()},
            "lr": float(self.opt.param_groups[0]["lr"]),  # torchao keeps it as a tensor
            f"{self.job.item_name}_per_s": round(rate, 1),
            "mfu": _rounded(mfu(rate * self.job.flops_per_item, peak * self.rt.world_size), 4),
            "peak_mem_mb": round(peak_memory_mb(self.rt.device), 1),
            "elapsed_s": round(self.elapsed(), 2),
        }
        self._write(record)
        only = self.job.online.shown if self.job.online else ()
        shown = {k: v for k, v in record.items() if not only or k in only or k not in metrics}
        display.update(self.step, shown, eta_s=(self.tc.steps - self.step) * seconds / max(window.steps, 1))
        self.last.update(metrics)

    def _evaluate(self, display: TrainDisplay) -> bool:
        """Held-out loss (and the plug-in's evaluation); True when this is the best checkpoint so far."""
        self.doing = f"the held-out evaluation at step {self.step}"
        with phase(f"evaluating at step {self.step}"):
            val, load = self._held_out()
        if not val:  # nothing held out (the plug-in said so when it was set up)
            return False
        if load:  # a mixture of experts: how the held-out tokens were routed, per layer
            val["expert_imbalance"] = sum(moe.imbalance(layer) for layer in load) / len(load)
            self._write({"step": self.step, "split": "experts", "load": load})
        self._write({"step": self.step, "split": "val", **{k: round(v, 6) for k, v in val.items()}})
        if self.rt.is_main:
            plots.run_curves(self.run_dir, self.run_dir / "curves.png", self.job.curve)
            if load:
                plots.expert_load(self.run_dir, self.run_dir / "experts.png")
        display.note(self.step, "val", val)
        self.last.update({f"val_{k}": v for k, v in val.items()})
        score = val.get(self.job.best_key) if self.job.best_key else None
        score = -score if score is not None and self.job.best_lowest else score  # self.best: the higher, the better
        if score is None or (self.best is not None and score <= self.best):
            return False
        self.best = score
        return True

    def _held_out(self) -> tuple[dict[str, float], list[list[int]]]:
        """The held-out loss of job.val (its first train.eval_batches batches) and job.evaluate's metrics;
        and, for a mixture of experts, the tokens of that pass each layer's experts received."""
        val, load = {}, []
        if self.job.val is not None:
            batches = sequential_batches(
                self.job.val, self.tc.batch_size, self.tc.seed, self.tc.eval_batches, self.rt.rank, self.rt.world_size
            )
            with moe.expert_load(moe.moe_layers(self.module)) as load:
                sums, count = held_out_sums(
                    self.module, batches, self.rt.device, self.tc.precision, self.job.loss_weight
                )
            val = self.job.held_out_metrics(self.rt.pooled_mean(sums, count))
        if self.job.evaluate is not None:
            val.update(self.job.evaluate(self.module, self.run_dir))
        return val, [layer for layer in load if sum(layer)]

    def _save(self, is_best: bool) -> None:
        self.doing = f"the checkpoint at step {self.step}"
        if self.rt.strategy.sharded:  # each process writes its shards; nothing is gathered
            if self.rt.is_main:
                checkpoint.staging(self.run_dir, self.step)
            self.rt.barrier()
            tmp = checkpoint.staging(self.run_dir, self.step, create=False)
            groups = shards.save(tmp, self.module, self.opt, self.saved)
            self.rt.barrier()
            if self.rt.is_main:
                shards.write_index(tmp)
                self._checkpoint(None, {"param_groups": groups}, is_best)
            self.rt.barrier()
            return
        weights = self.rt.strategy.state_dict(self.module)  # every rank takes part (DDP: rank 0's copy)
        optimizer = optimizers.plain(self.rt.strategy.optimizer_state_dict(self.module, self.opt))
        if self.saved is not None:
            weights = {k: v for k, v in weights.items() if k in self.saved}
        if self.rt.is_main:
            self._checkpoint(weights, optimizer, is_best)
        self.rt.barrier()

    def _checkpoint(self, weights: dict | None, optimizer: dict, is_best: bool) -> None:
        """Rank 0 writes the checkpoint (weights None: the processes' shards are in its staging directory)."""
        with phase(f"writing checkpoint step-{self.step:07d}"):
            state = {
                "optimizer": optimizer,
                "scheduler": self.sched.state_dict(),
                "data": self.batches.state_dict(),
                "rng": checkpoint.rng_state(),
                "best": self.best,
                "elapsed_s": self.elapsed(),
                "skipped": self.skipped,
                "window": self.window.state(),
                "rollouts": self.rollouts if self.job.online and self.step % self.job.online.reuse else None,
            }
            meta = {
                self.recipe.kind: self.recipe.plugin,
                "family": self.recipe.model.family,
                "partial": self.saved is not None,
                "processes": self.rt.world_size,
                "threads": self.rt.threads,
                "global_batch": self.tc.batch_size * self.tc.grad_accum * self.rt.world_size,
                **self.last,
            }
            checkpoint.save(
                self.run_dir,
                self.step,
                weights,
                state,
                meta,
                keep=self.tc.keep_checkpoints,
                best=is_best,
                staged=weights is None,
            )

    def _write(self, record: dict) -> None:
        if self.log is not None:
            self.log.write(record)

    def close(self) -> None:
        if isinstance(self.batches, Prefetcher):
            self.batches.close()
        if self.log is not None:
            self.log.close()


def _rounded(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


class _StopOnSignal:
    """SIGINT / SIGTERM ask training to stop at the next step boundary (after a checkpoint) instead of
    dying mid-step; a second Ctrl-C interrupts at once."""

    def __init__(self):
        self.requested = False
        self.previous = {}

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self.previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


class _Window:
    """The steps between two log lines: each step's metrics (device tensors until read), items, and
    the wall time of training (evaluations and checkpoints excluded)."""

    def __init__(self):
        self.metrics: list[tuple[int, dict[str, Tensor]]] = []
        self.items, self.started, self.excluded = 0, None, 0.0
        self.carried = 0.0  # training seconds of this window before a resume

    @property
    def steps(self) -> int:
        return len(self.metrics)

    def begin(self) -> None:
        if self.started is None:
            self.started = time.perf_counter()

    def add(self, step: int, metrics: dict[str, Tensor], items: int) -> None:
        self.metrics.append((step, metrics))
        self.items += items

    @contextlib.contextmanager
    def excluding(self):
        """Leave this block's time out of the window's (only if the window has begun: an evaluation
        right after a log line comes before the next window's first step)."""
        t0 = time.perf_counter()
        yield
        if self.started is not None:
            self.excluded += time.perf_counter() - t0

    def state(self) -> dict:
        """What a checkpoint keeps of an unfinished window, so that a resumed run's first log line
        averages the same steps as the uninterrupted run's."""
        return {"metrics": [[step, m] for step, m in self.read()], "items": self.items, "seconds": self.seconds()}

    @classmethod
    def from_state(cls, state: dict | None) -> _Window:
        window = cls()
        if state:
            window.metrics = [(int(step), {k: torch.tensor(v) for k, v in m.items()}) for step, m in state["metrics"]]
            window.items = int(state["items"])
            window.carried = float(state["seconds"])
        return window

    def read(self) -> list[tuple[int, dict[str, float]]]:
        """Every step's metrics as numbers: one transfer from the device for the whole window."""
        if not self.metrics:
            return []
        keys = list(self.metrics[0][1])
        # a resumed window's first steps come back from the checkpoint on the CPU, the rest on the device
        device = self.metrics[-1][1][keys[0]].device
        values = torch.stack([m[k].reshape(()).to(device) for _, m in self.metrics for k in keys]).tolist()
        return [
            (step, dict(zip(keys, values[i * len(keys) : (i + 1) * len(keys)])))
            for i, (step, _) in enumerate(self.metrics)
        ]

    def seconds(self) -> float:
        return self.carried + time.perf_counter() - (self.started or time.perf_counter()) - self.excluded
