"""The memory plan: what a run will hold at its peak, before it holds it.

Nothing here is a formula of a family. The plan runs the run's own training step (its loss, model
family and widths, adapters, heads, frozen models, optimizer, precision and one micro-batch at the
recipe's lengths) on two probes of the model, with one and with two transformer blocks and random
weights, and counts the bytes of every tensor the step creates (`LiveBytes`). Every figure (weights,
gradients, optimizer states, the step's transient peak: activations kept for backward, recomputation,
the loss's logits chunk, temporaries) is linear in the number of blocks, so the two probes give it for
the real depth. What the process holds besides tensors (Python, libraries, the tokenized data) is its
resident memory when the plan is made, less the model's own tensors.

torch's MemTracker does the same counting but cannot follow a model with frozen parameters (it hooks
every parameter's gradient), which LoRA, QLoRA and a DPO reference all have: hence `LiveBytes`.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from ..adapters import frozen_in_nf4, holds_nf4, method
from ..errors import UserError
from ..models import TEXT_FAMILIES, build_model, transformer_blocks
from ..models.moe import moe_layers
from ..models.nf4 import NF4Linear
from ..recipe import parse_limit
from . import optimizers, scratch
from .perf import peak_resident_bytes, proc_bytes

MARGIN = 0.9  # train.memory_limit auto: this share of what the device has
DEPTH_FIELDS = ("n_layer", "n_decoder_layer", "decoder_n_layer")  # the block counts a probe shrinks


class LiveBytes(TorchDispatchMode):
    """The bytes of every tensor storage created inside it and still alive, and their peak. Views share
    their storage (counted once); a storage is forgotten when it is freed. `held` tensors exist already
    (weights, optimizer states): an op that updates them in place creates nothing."""

    def __init__(self, held: Iterable[Tensor] = (), shapes_only_at: int = 0):
        super().__init__()
        self.live, self.peak = 0, 0
        self._held: dict[int, int] = {}  # id of a live storage -> its bytes
        self._known = {id(t.untyped_storage()) for t in held}
        self.shapes_only_at = shapes_only_at  # see _allocated_only
        self._computed: set = set()  # the (op, shapes) _allocated_only has let run once

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = self._allocated_only(func, args, kwargs) if self.shapes_only_at else None
        if out is None:
            out = func(*args, **kwargs)
        for t in tree_flatten(out)[0]:
            if isinstance(t, Tensor):
                self._count(t)
        return out

    def _allocated_only(self, func, args, kwargs):
        """An op on a tensor with a dimension of `shapes_only_at` (a large vocabulary: the output layer's
        products and the loss's passes over its logits, most of a probe's time), or one of the loss's
        loops over the vocabulary's tiles (scratch.in_repeated_ops), allocates what it would
        and computes nothing after its first time (each op and shapes run once, so that the compute
        libraries hold the buffers the run's will): its output shapes come from the op's meta kernel,
        its values are zeros, an in-place or out= op leaves its tensor as it is. The bytes counted are
        the same; nothing the plan reads depends on those values (the routing of a mixture reads the
        blocks' own, computed). None: compute it (a view, an op on other tensors, one with no meta
        kernel, a factory such as empty with no tensor to read, or the first of its kind)."""
        flat = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor)]
        if (
            func.is_view
            or not flat
            or not (scratch.in_repeated_ops() or any(self.shapes_only_at in t.shape for t in flat))
        ):
            return None
        key = (func, *(tuple(t.shape) for t in flat))
        if key not in self._computed:  # each kind once for real: the libraries keep what its kernels use
            self._computed.add(key)
            return None
        if "out" in kwargs:
            return kwargs["out"]
        if func._schema.name.endswith("_") or any(
            a.alias_info and a.alias_info.is_write for a in func._schema.arguments
        ):
            return args[0]
        to_meta = lambda x: x.to("meta") if isinstance(x, Tensor) else x  # noqa: E731
        try:
            shaped = func(*tree_map(to_meta, args), **tree_map(to_meta, kwargs))
        except Exception:  # no meta kernel, or a shape that depends on values
            return None
        device = flat[0].device
        return tree_map(
            lambda m: (
                torch.empty_strided(m.shape, m.stride(), dtype=m.dtype, device=device).zero_()
                if isinstance(m, Tensor)
                else m
            ),
            shaped,
        )

    def _count(self, t: Tensor) -> None:
        if type(t) is not Tensor and hasattr(t, "__tensor_flatten__"):  # a wrapper subclass (torchao's)
            for name in t.__tensor_flatten__()[0]:
                inner = getattr(t, name)
                if isinstance(inner, Tensor):
                    self._count(inner)
            return
        storage = t.untyped_storage()
        key, size = id(storage), storage.nbytes()
        if key in self._held or key in self._known or size == 0:
            return
        self._held[key] = size
        self.live += size
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._freed, key)

    def _freed(self, key: int) -> None:
        self.live -= self._held.pop(key, 0)


@dataclass(frozen=True)
class Figures:
    """Bytes a training step holds, for one model depth (a probe's, or the real one's by extrapolation)."""

    weights: float  # the trained model's parameters and buffers, and the heads (QLoRA's base as NF4)
    frozen: float  # models the loss reads but never trains (a DPO reference, a teacher)
    optimizer: float  # the optimizer's states
    step: float  # the peak of one micro-batch's forward, backward and update: activations, gradients, temporaries

    def extrapolated(self, other: Figures, blocks: tuple[int, int], to: int) -> Figures:
        """self at blocks[0], other at blocks[1] -> the figures at `to` blocks (each linear in blocks)."""
        a, b = blocks
        return Figures(
            *(x + (y - x) * (to - a) / (b - a) for x, y in zip(dataclasses.astuple(self), dataclasses.astuple(other)))
        )


@dataclass(frozen=True)
class Plan:
    """What one process of a run holds at its peak, in bytes."""

    figures: Figures  # with the chosen recomputation
    other_step: float  # the step's peak with the other setting of recomputation
    gradients: float  # what the gradients alone take (part of `step`)
    runtime: float  # the process besides the model's tensors: Python, libraries, data
    reading: float  # the peak while the weights were read (measured in a run; the file and the model in a dry run)
    checkpointing: bool
    micro_batch: int
    rows: int  # the micro-batch's sequence length (0: not text)
    capacity: float  # what the device has for this process
    device: str
    processes: int = 1
    strategy: str = "none"

    @property
    def training(self) -> float:
        f = self.figures
        return self.runtime + f.weights + f.frozen + f.optimizer + f.step

    @property
    def peak(self) -> float:
        return max(self.training, self.reading)

    def as_dict(self) -> dict:
        """What run.json keeps of the plan (bytes)."""
        return {
            **{k: round(v) for k, v in dataclasses.asdict(self.figures).items()},
            "gradients": round(self.gradients),
            "runtime": round(self.runtime),
            "reading": round(self.reading),
            "peak": round(self.peak),
            "capacity": round(self.capacity),
            "checkpointing": self.checkpointing,
            "micro_batch": self.micro_batch,
        }

    def fits(self, limit: float) -> bool:
        """Whether training fits `limit` (reading the weights has happened by the time the limit applies)."""
        return limit <= 0 or self.training <= limit

    def summary(self) -> str:
        """The one line a run's header prints."""
        f = self.figures
        shape = f"{self.micro_batch} x {self.rows}" if self.rows else f"{self.micro_batch}"
        return (
            f"memory plan: {gb(self.peak)} peak of {gb(self.capacity)} ({self.where()}): weights {gb(f.weights)}"
            + (f", frozen {gb(f.frozen)}" if f.frozen else "")
            + f", optimizer {gb(f.optimizer)}, step {gb(f.step)} (micro-batch {shape}, "
            + f"recomputation {'on' if self.checkpointing else 'off'}), process {gb(self.runtime)}"
            + (f"; reading the weights {gb(self.reading)}" if self.reading > self.training else "")
        )

    def where(self) -> str:
        if self.device == "cpu":
            return "RAM" + (f", per process of {self.processes}" if self.processes > 1 else "")
        return f"{self.device} memory" + (f", per process of {self.processes}" if self.processes > 1 else "")

    def rows_table(self) -> list[tuple[str, str]]:
        """The plan, line by line, for --dry-run."""
        f = self.figures
        on, off = (f.step, self.other_step) if self.checkpointing else (self.other_step, f.step)
        rows = [
            ("weights (trained model and heads)", f.weights),
            ("frozen models (reference, teacher)", f.frozen),
            ("gradients (in the step's peak)", self.gradients),
            ("optimizer states", f.optimizer),
            (f"step peak, recomputation off{' (chosen)' if not self.checkpointing else ''}", off),
            (f"step peak, recomputation on{' (chosen)' if self.checkpointing else ''}", on),
            ("the process (Python, libraries, data)", self.runtime),
            ("reading the weights (the file's tensors and the model)", self.reading),
            ("planned peak", self.peak),
            (f"the device has ({self.where()})", self.capacity),
        ]
        return [(what, gb(n)) for what, n in rows if n == n]  # the setting not planned is nan


def gb(n: float) -> str:
    """Bytes for a person: GB, MB, or kB below a megabyte (a 1 KB limit is not "0 MB")."""
    if n >= 2**30:
        return f"{n / 2**30:.2f} GB"
    return f"{n / 2**20:.0f} MB" if n >= 2**20 or n == 0 else f"{n / 2**10:.0f} kB"


# --- what the process and the device have ---------------------------------------------------------


def resident_bytes() -> float:
    """This process's resident memory now (Linux: /proc/self/status; elsewhere its peak so far)."""
    now = proc_bytes("/proc/self/status", "VmRSS:")
    return now if now is not None else peak_resident_bytes()


def device_capacity(device: torch.device, local_processes: int = 1) -> float:
    """What one process may hold: a GPU's memory, or on the CPU the memory available now plus what this
    process already holds, shared by the processes on this machine."""
    if device.type == "cuda":
        return float(torch.cuda.mem_get_info(device)[1])
    available = available_ram()
    if available is None:
        import os

        available = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    return (available + resident_bytes() * local_processes) / local_processes


def available_ram() -> float | None:
    """The memory the system could give now (Linux's MemAvailable), or None where it does not say."""
    return proc_bytes("/proc/meminfo", "MemAvailable:")


def tensor_bytes(*modules: nn.Module) -> float:
    """Bytes of the real (not meta) parameters and buffers of `modules` (QLoRA's NF4 base as held)."""
    total = 0.0
    for module in modules:
        for m in module.modules():
            if isinstance(m, NF4Linear):
                total += m.weight_bytes()
            for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)]:
                if not t.is_meta and not (isinstance(m, NF4Linear) and t is getattr(m, "weight", None)):
                    total += t.numel() * t.element_size()
    return total


# --- the probes -----------------------------------------------------------------------------------


def probe_config(cfg, blocks: int):
    """The model config with `blocks` blocks in each of its stacks (encoder, decoder)."""
    if hasattr(cfg, "with_layers"):  # a config with per-layer settings cuts them too
        return cfg.with_layers(blocks)
    changes = {f: blocks for f in DEPTH_FIELDS if getattr(cfg, f, 0)}
    return dataclasses.replace(cfg, **changes)


def widened(batch: dict, length: int) -> dict:
    """A batch at the recipe's length: every 2-D (or wider) tensor as long as the longest one is padded
    to `length` by repeating its last column (ids stay ids, masks masks), so the plan holds for the
    longest batch the data can give, not for the first one drawn."""
    seq = [v.size(1) for v in batch.values() if isinstance(v, Tensor) and v.dim() >= 2 and not v.is_floating_point()]
    if not seq or max(seq) >= length:
        return batch
    t = max(seq)
    out = {}
    for k, v in batch.items():
        if isinstance(v, Tensor) and v.dim() >= 2 and v.size(1) == t:
            tail = v[:, -1:].expand(v.size(0), length - t, *v.shape[2:])
            v = torch.cat([v, tail], dim=1)
        out[k] = v
    return out


@dataclass
class Step:
    """What the plan needs of a run to replay its training step on a probe."""

    cfg: object  # the model's config
    blocks: int  # transformer blocks in the real model
    make_trained: Callable[[nn.Module], nn.Module]  # probe model -> what the run trains (adapters applied, heads)
    frozen: dict  # Job.frozen: name -> the real frozen model (its config is read; a probe replaces it)
    batch: dict  # one micro-batch at the recipe's lengths
    optimizer: Callable[[nn.Module], torch.optim.Optimizer]
    device: torch.device
    autocast: Callable[[], contextlib.AbstractContextManager]
    min_blocks: int = 1  # the fewest blocks a probe may have (the blocks the run's features read)


def probe_figures(step: Step, blocks: int, checkpointing: bool) -> tuple[Figures, float]:
    """Run a training step of a `blocks`-deep probe, counting its forward and backward, with the
    optimizer's states already there (as they are for every step but the first) -> (its figures, the
    gradients' bytes)."""
    from .trainer import set_checkpointing

    with torch.random.fork_rng(devices=[step.device] if step.device.type == "cuda" else []):
        torch.manual_seed(0)
        with torch.device(step.device):
            model = build_model(probe_config(step.cfg, blocks))
        trained = step.make_trained(model).to(step.device).train()
        set_checkpointing(trained, checkpointing)
        swapped = {n: probe_frozen(m, blocks, step.device) for n, m in step.frozen.items()}
        originals = dict(step.frozen)
        step.frozen.update(swapped)
        try:
            opt = step.optimizer(trained)
            first_update(trained, opt)
            counter = LiveBytes(held_tensors(trained, opt, *swapped.values()), shapes_only_at=large_vocab(step.cfg))
            with counter:  # the gradients are alive at the end of the backward pass: counted
                backward(trained, step)
            update(opt)
            grads = sum(p.numel() * p.element_size() for p in trained.parameters() if p.requires_grad)
            figures = Figures(
                weights=tensor_bytes(trained),
                frozen=tensor_bytes(*swapped.values()),
                optimizer=float(optimizers.state_bytes(opt)),
                step=float(counter.peak),
            )
        finally:
            step.frozen.update(originals)
    return figures, float(grads)


LARGE_VOCAB = 16384  # a vocabulary from which the probes allocate its products without computing them


def large_vocab(cfg) -> int:
    """The model's vocabulary when the output layer's work dominates a probe (LiveBytes._allocated_only),
    else 0: smaller vocabularies are computed as they are."""
    text = getattr(cfg, "text", cfg)  # a vision-language model's decoder
    vocab = getattr(text, "vocab_size", 0) or 0
    return vocab if vocab >= LARGE_VOCAB else 0


def held_tensors(*objects) -> list[Tensor]:
    """The tensors a step finds already there: modules' parameters and buffers, optimizers' states."""
    out = []
    for obj in objects:
        if isinstance(obj, nn.Module):
            out += [*obj.parameters(), *obj.buffers()]
        else:
            out += [v for state in obj.state.values() for v in state.values() if isinstance(v, Tensor)]
    flat = []
    for t in out:
        if type(t) is not Tensor and hasattr(t, "__tensor_flatten__"):
            flat += [getattr(t, n) for n in t.__tensor_flatten__()[0] if isinstance(getattr(t, n), Tensor)]
        else:
            flat.append(t)
    return flat


def probe_frozen(model: nn.Module, blocks: int, device: torch.device) -> nn.Module:
    """A frozen model's probe: its config at `blocks` blocks, as the run holds it (no gradients, eval)."""
    with torch.device(device):
        probe = build_model(probe_config(model.cfg, blocks))
    probe = probe.eval().requires_grad_(False)
    return frozen_in_nf4(probe) if holds_nf4(model) else probe  # a teacher held in NF4


def backward(trained: nn.Module, step: Step) -> None:
    with step.autocast():
        loss, _ = trained(step.batch)
    loss.backward()


def first_update(trained: nn.Module, opt: torch.optim.Optimizer) -> None:
    """The optimizer's states as the run's first step leaves them, without a pass to get there: a step
    on zero gradients (every run plans, so a probe's second pass would be paid by every run)."""
    for p in trained.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    update(opt)


def update(opt: torch.optim.Optimizer) -> None:
    """The optimizer's step, never counted: it updates in place (torchao's low-bit step is compiled
    with fullgraph, which a dispatch mode would stop), and its states are counted as they stand."""
    opt.step()
    opt.zero_grad(set_to_none=True)


def plan_step(step: Step, checkpointing: bool) -> tuple[Figures, float]:
    """The figures at the model's real depth, from probes of two depths (or the real depth itself)."""
    depths = probe_depths(max(getattr(step.cfg, f, 0) for f in DEPTH_FIELDS), step.min_blocks)
    measured = [probe_figures(step, d, checkpointing) for d in depths]
    if len(depths) == 1:
        return measured[0]
    (one, g1), (two, g2) = measured
    n1, n2 = blocks_of(step.cfg, depths[0]), blocks_of(step.cfg, depths[1])
    grads = g1 + (g2 - g1) * (step.blocks - n1) / (n2 - n1)
    return one.extrapolated(two, (n1, n2), step.blocks), grads


def probe_depths(depth: int, needed: int) -> tuple[int, ...]:
    """Blocks per stack of the two probes: the fewest the run's features need (a classifier reading the
    last four blocks needs four) and one more; the model's own depth when it is no deeper."""
    low = max(1, needed)
    if depth <= low:
        return (depth,)
    return (low, low + 1)


def blocks_of(cfg, blocks: int) -> int:
    """How many transformer blocks a probe of `blocks` blocks per stack has."""
    with torch.device("meta"):
        return len(transformer_blocks(build_model(probe_config(cfg, blocks))))


def per_process(figures: Figures, strategy, processes: int) -> Figures:
    """One process's share, as the run's distributed strategy (runtime.Strategy) holds it: FSDP shards
    weights and optimizer states (and frozen models, as the run wraps them); DDP holds everything whole,
    plus its gradient buckets (counted with the step, Strategy.gradient_copies)."""
    return dataclasses.replace(
        figures,
        weights=strategy.held(figures.weights, processes),
        frozen=strategy.held(figures.frozen, processes),
        optimizer=strategy.held(figures.optimizer, processes),
    )


def choose(plans: Callable[[bool, int], Plan], batch_size: int, setting: str, micro_batch: int, limit: float):
    """train.activation_checkpointing and train.memory_limit -> (the plan the run follows, a note saying
    what was chosen, '' when nothing was). auto keeps recomputation off when the run fits without it
    and it does not pay (recompute_pays); then the batch is split into ever smaller micro-batches
    (accumulated: the same gradient) until the plan fits. When nothing fits: a one-line error with the
    smallest plan's figures, before any data is trained on."""
    micros = [micro_batch] if micro_batch else [m for m in range(batch_size, 0, -1) if batch_size % m == 0]
    checkpointing = setting == "blocks"
    why = ""
    if setting == "auto":
        off = plans(False, micros[0])
        if off.fits(limit) and not recompute_pays(off):
            return off, ""
        checkpointing = True
        why = (
            f"the step's activations ({gb(off.figures.step)}) outweigh the weights and states"
            if off.fits(limit)
            else f"{gb(off.peak)} planned without it"
        )
    for micro in micros:
        plan = plans(checkpointing, micro)
        if plan.fits(limit):
            chose = [f"recomputation on ({why})"] if why else []
            if micro != micros[0]:
                chose.append(f"micro-batches of {micro} ({batch_size // micro} per batch of {batch_size}, accumulated)")
            return plan, (f"{' and '.join(chose)}; planned peak {gb(plan.peak)} of {gb(limit)}" if chose else "")
    f = plan.figures
    raise UserError(
        f"this run does not fit train.memory_limit {gb(limit)}: with recomputation "
        f"{'on' if plan.checkpointing else 'off'} and micro-batches of {plan.micro_batch} its planned peak is "
        f"{gb(plan.peak)} (weights {gb(f.weights)}, frozen {gb(f.frozen)}, optimizer {gb(f.optimizer)}, step "
        f"{gb(f.step)}, process {gb(plan.runtime)}); try --train lora or qlora, optim.name adamw8bit, "
        f"or a shorter data.seq_len"
    )


# bytes per trained parameter of AdamW's two moments, their scales left out (a floor)
MOMENT_BYTES = {"adamw": 8.0, "adamw8bit": 2.0, "adamw4bit": 1.0}


def trained_part(recipe) -> str:
    """finetune.train, or "all" for pretraining."""
    return "all" if recipe.finetune is None else recipe.finetune.train


def process_capacity(rt) -> float:
    """What the device has for this process, the processes on this machine sharing it."""
    import os

    return device_capacity(rt.device, int(os.environ.get("LOCAL_WORLD_SIZE", rt.world_size)))


def floor_figures(model: nn.Module, recipe, frozen_copies: int = 0) -> Figures:
    """What a run holds whatever its batch, from its model's shapes alone (the meta device: nothing
    read): the weights (QLoRA's block matrices at NF4's 4 bits), `frozen_copies` copies of them (a
    reference model) and, when every weight trains, their gradients (counted as the step's) and
    optimizer states. Adapters, heads and activations are left out: a floor, for refusing a run
    before its weights and data are read."""
    train = method(trained_part(recipe))
    quantized = {id(p) for b in transformer_blocks(model) for p in b.parameters() if p.dim() == 2}
    weights = sum(p.numel() * (0.5 if train.quantized and id(p) in quantized else 4.0) for p in model.parameters())
    trained = sum(p.numel() for p in model.parameters()) if train.whole else 0
    return Figures(
        weights=weights,
        frozen=weights * frozen_copies,
        optimizer=trained * MOMENT_BYTES[recipe.optim.name],
        step=trained * 4.0,
    )


def refuse_beyond(floor: Figures, limit: float, recipe) -> None:
    """A one-line error when the floor alone passes the limit (0: no limit)."""
    train = trained_part(recipe)
    total = floor.weights + floor.frozen + floor.optimizer + floor.step
    if limit <= 0 or total <= limit:
        return
    parts = [f"its weights ({gb(floor.weights)})"]
    if floor.frozen:
        parts.append(f"the frozen reference copy ({gb(floor.frozen)})")
    if floor.step:
        parts += [f"their gradients ({gb(floor.step)})", f"optimizer states ({gb(floor.optimizer)})"]
    held = "its weights" if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
    hint = method(train).memory_hint
    if floor.frozen and not method(train).whole:
        hint = f"{recipe.plugin}.reference base (the model with its adapters off: no copy), or {hint}"
    raise UserError(
        f"this run does not fit train.memory_limit {gb(limit)}: before any activation, {held} take "
        f"{gb(total)} (checked before its weights or data were read); try {hint}"
    )


def clone_heads(heads: nn.ModuleDict) -> nn.ModuleDict:
    """The probe trains a copy of the Job's heads: the run's own are never touched."""
    return copy.deepcopy(heads)


def recompute_pays(plan: Plan) -> bool:
    """activation_checkpointing auto, when the run fits without it: recompute when the step's
    activations outweigh what the model holds anyway (weights, frozen models, optimizer states) and
    pass 1 GB, where a third more compute buys most of the memory (a small model's runs keep their speed)."""
    f = plan.figures
    return f.step > max(f.weights + f.frozen + f.optimizer, 2**30)


# --- a run's plan ---------------------------------------------------------------------------------


def _libc():
    """The C library, or None where it cannot be loaded."""
    import ctypes
    import ctypes.util

    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def returned_to_os() -> None:
    """Give freed heap memory back to the system (glibc), so that resident memory is what is held."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def trim_after_each_block(model: nn.Module) -> None:
    """While training on the CPU, give the heap's free pages back after every transformer block's forward
    (recomputed forwards in the backward pass too). Below the mmap threshold, activations come from
    glibc's heap, and the holes they leave between differently sized blocks stay resident: the peak
    then runs well above the tensors the plan counts. malloc_trim returns the holes as the step goes,
    at no measured cost (docs/results/measured.md); in eval mode nothing is done, so decoding, which
    calls every block once a token, does not pay for it."""
    libc = _libc()
    if libc is None or not hasattr(libc, "malloc_trim"):
        return

    def trim(block: nn.Module, args, output) -> None:
        if block.training:
            libc.malloc_trim(0)

    for block in transformer_blocks(model):
        block.register_forward_hook(trim)


MMAP_THRESHOLD = 1 << 20  # with a memory limit on the CPU: blocks from 1 MB up are mapped and unmapped
DEFAULT_MMAP_THRESHOLD = 32 << 20  # without one: glibc's own ceiling, fixed from the start


def follow_the_plan(limited: bool = True) -> bool:
    """Make resident memory on the CPU follow the tensors the plan counts. glibc raises its mmap
    threshold (to 32 MB) after the first large block is freed and its trim threshold with it, and from
    then on serves activations from a heap that keeps what is freed resident. A threshold set once, at
    the start, stops both: at 32 MB (the default; glibc's own ceiling) the heap's top is given back as
    it frees, and trim_after_each_block returns its holes; with train.memory_limit set (`limited`), 1 MB
    maps and unmaps every large block, closest to the plan, at the cost of the kernel zeroing fresh
    pages every step, so only when a limit asks for it, or when a 4-bit base is dequantized on every
    use (QLoRA: temporaries of every linear's size, which a heap keeps apart). Figures:
    docs/results/measured.md. Returns whether the allocator took the setting (glibc only)."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    return bool(libc.mallopt(-3, MMAP_THRESHOLD if limited else DEFAULT_MMAP_THRESHOLD))  # M_MMAP_THRESHOLD


def first_batch(source, rows: int, seed: int, length: int, device: torch.device) -> dict:
    """`rows` training examples at the recipe's length; a stream's position is left where it was."""
    from ..data.sampler import Stream, make_sampler
    from .runtime import to_device

    saved = source.state_dict() if isinstance(source, Stream) else None
    batch = make_sampler(source, rows, seed).next_batch()
    if saved is not None:
        source.load_state_dict(saved)
    return to_device(widened(batch, length), device)


# a dry run's estimate of reading the weights, in copies of their fp32 bytes held at once: the file's
# tensors and the model they are loaded into; a GGUF is dequantized through numpy first (the factor
# was measured on SmolLM2's Q4_1 file: docs/results/measured.md)
READ_COPIES = {"gguf": 2.6, "other": 2.0}


def stacked_bytes(model: nn.Module) -> int:
    """The weights a checkpoint holds as pieces that reading stacks into one tensor (a mixture's experts,
    one tensor per expert in the file): one more copy of them while they are read (measured: a
    Qwen3-MoE-shaped LoRA SFT's reading peak, docs/results/measured.md)."""
    return sum(p.numel() * 4 for layer in moe_layers(model) for p in layer.experts.parameters())


def probed(probes: Callable[[], tuple]) -> tuple:
    """probes(), then the garbage it left collected. Only what it made is looked at: the objects that
    were there before are set aside (gc.freeze) while the collector runs. A whole collection walks
    every object of the process, 0.3 s and more in one that has imported transformers (a notebook, the
    test suite), where a run's probes leave a few thousand."""
    import gc

    gc.freeze()
    try:
        result = probes()
        gc.collect()
    finally:
        gc.unfreeze()
    return result


def planner(recipe, job, model: nn.Module, rt, reading, dry_run: bool = False, restoring: float = 0.0):
    """-> (plans(checkpointing, micro_batch) -> Plan, what the device has for this process), for the run
    about to start: `model` is the backbone (real, or on the meta device for --dry-run); `reading` the
    measured peak so far (bytes), or for a dry run the copies of the weights reading holds at once
    (READ_COPIES; 0 for a fresh model, which is not read); `restoring`: the bytes of the checkpoint a
    resumed run reads, which it holds at once with the model and its new optimizer states."""
    from .. import adapters
    from .runtime import autocast_context
    from .trainer import ObjectiveModule, build_optimizer

    ft, t = recipe.finetune, recipe.train
    returned_to_os()
    held = tensor_bytes(model, job.heads, *job.frozen.values())
    on_gpu = rt.device.type == "cuda"
    runtime = 0.0 if on_gpu else max(resident_bytes() - held, 0.0)
    if dry_run:  # an estimate: the copies of the fp32 weights reading holds, above the process
        copies, weights = reading, sum(p.numel() * 4 for p in model.parameters())
        reading = runtime + copies * weights + stacked_bytes(model) if copies and not on_gpu else 0.0
    length = min(recipe.data.seq_len, getattr(model.cfg, "max_seq_len", recipe.data.seq_len))
    capacity = process_capacity(rt)

    def make_trained(probe: nn.Module) -> nn.Module:
        if ft is not None:
            adapters.apply(probe, ft.train, recipe.adapter, ft.freeze_router, ft.train_vision)
        return ObjectiveModule(probe, clone_heads(job.heads), job.loss)

    cache: dict = {}

    def after_probes() -> float:
        """The process once the probes have run a training step and freed it (probed): what the compute
        libraries keep from their first step (thread pools, kernels' buffers), which a lean process (a
        resumed run) has not paid for when the plan starts. The loss's reused buffer of logits is given
        back first: the probes' step counted it, and the run's first step allocates it again."""
        scratch.release_buffers()
        returned_to_os()
        return resident_bytes() - held

    def plans(checkpointing: bool, micro: int, both: bool = dry_run) -> Plan:
        def measured(ckpt: bool, rows: int):
            if (ckpt, rows) not in cache:
                step = Step(
                    cfg=model.cfg,
                    blocks=len(transformer_blocks(model)),
                    make_trained=make_trained,
                    frozen=job.frozen,
                    batch=(job.plan_batch or (lambda b: b))(first_batch(job.train, rows, t.seed, length, rt.device)),
                    optimizer=lambda m: build_optimizer(m, recipe, job.head_lr),
                    device=rt.device,
                    autocast=lambda: autocast_context(t.precision, rt.device),
                    min_blocks=job.blocks_read,
                )
                cache[ckpt, rows] = probed(lambda: plan_step(step, ckpt))
            return cache[ckpt, rows]

        figures, grads = measured(checkpointing, micro)
        other = measured(not checkpointing, micro)[0].step if both else float("nan")
        process = runtime if on_gpu else max(runtime, after_probes())
        extra = (rt.strategy.gradient_copies - 1) * grads  # DDP's buckets: a second copy of the gradients
        figures = per_process(dataclasses.replace(figures, step=figures.step + extra), rt.strategy, rt.world_size)
        restored = process + held + figures.optimizer + restoring if restoring else 0.0
        return Plan(
            figures=figures,
            other_step=other,
            gradients=grads,
            runtime=process,
            reading=max(reading, restored),
            checkpointing=checkpointing,
            micro_batch=micro,
            rows=length if recipe.model.family in TEXT_FAMILIES else 0,
            capacity=capacity,
            device=rt.device.type,
            processes=rt.world_size,
            strategy=rt.strategy.name,
        )

    return plans, capacity


def limit_of(setting: str, capacity: float) -> float:
    """train.memory_limit in bytes: auto is MARGIN of what the device has; 0 is no limit."""
    limit = parse_limit(setting)
    return MARGIN * capacity if limit is None else limit
