"""Where a run executes: the device, this process's rank, and the distribution strategy.

The trainer never names DDP or FSDP itself: it asks the strategy to wrap the module, to say whether
a micro-batch synchronises gradients, to clip, and for the weights and optimizer state to save or
load. `none` (one process), `ddp` and `fsdp` (FSDP2's fully_shard) are here; another strategy is
one more class with the same methods.

Every strategy saves the same thing: the full weights and the optimizer state keyed by parameter
name (torch.distributed.checkpoint's full state dicts), so a checkpoint written by one process,
by DDP or by FSDP resumes under any of them, on any number of processes.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..errors import UserError


def state_dicts():
    """torch.distributed.checkpoint's state-dict functions, imported when a checkpoint is first saved
    or loaded (a command that saves nothing should not pay for the import)."""
    from torch.distributed.checkpoint import state_dict

    return state_dict


def options(full: bool, **settings):
    """torch.distributed.checkpoint's StateDictOptions: full (whole tensors) or each process's shards."""
    return state_dicts().StateDictOptions(full_state_dict=full, **settings)


class Strategy:
    """One process: the module as it is. A distributed strategy (DDP, FSDP) answers for itself what the
    rest of tfcli asks of it (how checkpoints are written, what one process holds for the memory plan,
    whether processes must run forward passes together), as torchtitan's ParallelDims does: nobody
    compares its name."""

    name = "none"  # as train.strategy names it (shown, never compared)
    multiprocess = False  # runs under torchrun, in a process group
    sharded = False  # each process holds a share of the weights and optimizer states: checkpoints are shards
    lockstep = False  # every forward pass is a collective: processes generate until all their rows stop
    gradient_copies = 1  # copies of the gradients a step holds (DDP's buckets hold a second)

    def held(self, nbytes: float, processes: int) -> float:
        """What one process holds of `nbytes` of weights, frozen models or optimizer states."""
        return nbytes

    def wrap(self, module: nn.Module, precision: str = "fp32") -> nn.Module:
        return module

    def wrap_frozen(self, module: nn.Module) -> nn.Module:
        """A model that only runs forward (Job.frozen): a whole copy in every process, with nothing to
        synchronise (no gradients); DDP and FSDP keep it so too."""
        return module

    def sync_gradients(self, wrapped: nn.Module, sync: bool):
        """Context for one micro-batch's backward; sync=False defers the gradient all-reduce."""
        return contextlib.nullcontext()

    def clip_grad_norm(self, module: nn.Module, max_norm: float) -> Tensor:
        return nn.utils.clip_grad_norm_(module.parameters(), max_norm)

    def state_dict(self, module: nn.Module) -> dict[str, Tensor]:
        """The full (unsharded) weights, as every rank's copy of the module holds them."""
        return module.state_dict()

    def load_state_dict(self, module: nn.Module, state: dict[str, Tensor], strict: bool = True) -> None:
        module.load_state_dict(state, strict=strict)

    def optimizer_state_dict(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        """The optimizer state keyed by parameter name (the same for every strategy)."""
        return state_dicts().get_optimizer_state_dict(module, optimizer, options=options(True))

    def load_optimizer_state_dict(self, module: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
        if any(isinstance(k, int) for k in state.get("state", {})) or any(
            isinstance(p, int) for g in state.get("param_groups", []) for p in g["params"]
        ):
            optimizer.load_state_dict(state)  # a checkpoint from before 0.3: keyed by position
            return
        load_optimizer_state(module, optimizer, state, options(True, strict=False))


class DDPStrategy(Strategy):
    """DistributedDataParallel: a full replica per process, gradients all-reduced each step."""

    name = "ddp"
    multiprocess = True
    gradient_copies = 2

    def wrap(self, module: nn.Module, precision: str = "fp32") -> nn.Module:
        # a QLoRA base's NF4 weights stay out of DDP's broadcast from rank 0, which changed them on the
        # other ranks (a tensor subclass; the first loss moved by 5e-3); every process read and quantized the
        # same file, and they are frozen, so there is nothing to synchronise
        from ..models.nf4 import NF4Linear

        frozen_nf4 = [f"{name}.weight" for name, m in module.named_modules() if isinstance(m, NF4Linear)]
        nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, frozen_nf4)
        return nn.parallel.DistributedDataParallel(module)

    def sync_gradients(self, wrapped: nn.Module, sync: bool):
        return contextlib.nullcontext() if sync else wrapped.no_sync()


class FSDPStrategy(Strategy):
    """FSDP2 (fully_shard): every transformer block, then the whole module, sharded over the
    processes; parameters gathered for each block's forward and backward, gradients reduce-scattered.
    With bf16 on a GPU, blocks compute in bf16 and reduce gradients in fp32 (MixedPrecisionPolicy).
    Frozen models (a DPO reference) are sharded the same way. Checkpoints are each process's shards
    (engine/shards.py); a whole checkpoint (from one process or DDP) is read by every rank."""

    name = "fsdp"
    multiprocess = True
    sharded = True
    lockstep = True

    def held(self, nbytes: float, processes: int) -> float:
        return nbytes / max(processes, 1)

    def wrap(self, module: nn.Module, precision: str = "fp32") -> nn.Module:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        from ..models import transformer_blocks
        from ..models.nf4 import unshardable

        world = dist.get_world_size() if dist.is_initialized() else 1
        if matrix := unshardable(module, world):
            raise UserError(
                f"--train qlora under FSDP: the NF4 weight of {matrix} does not split into {world} equal shares; "
                "run on a number of processes its rows and scales divide (2, 4 or 8 for most models), or with ddp"
            )
        cuda = next(module.parameters()).device.type == "cuda"
        mp = (
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if precision == "bf16" and cuda
            else MixedPrecisionPolicy()
        )
        for block in transformer_blocks(module):
            fully_shard(block, mp_policy=mp)
        fully_shard(module, mp_policy=mp)
        return module

    def wrap_frozen(self, module: nn.Module) -> nn.Module:
        """A frozen model sharded like the trained one: each process holds its share of the weights and
        gathers one block at a time for the forward pass, instead of a whole copy per process."""
        return self.wrap(module)

    @contextlib.contextmanager
    def sync_gradients(self, wrapped: nn.Module, sync: bool):
        wrapped.set_requires_gradient_sync(sync)
        try:
            yield
        finally:
            wrapped.set_requires_gradient_sync(True)

    def clip_grad_norm(self, module: nn.Module, max_norm: float) -> Tensor:
        norm = nn.utils.clip_grad_norm_([p for p in module.parameters() if p.grad is not None], max_norm)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def state_dict(self, module: nn.Module) -> dict[str, Tensor]:
        return state_dicts().get_model_state_dict(
            module, options=options(True, cpu_offload=True)
        )  # full on rank 0, empty elsewhere

    def load_state_dict(self, module: nn.Module, state: dict[str, Tensor], strict: bool = True) -> None:
        state_dicts().set_model_state_dict(module, state, options=options(True, strict=strict))

    def optimizer_state_dict(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        return state_dicts().get_optimizer_state_dict(module, optimizer, options=options(True, cpu_offload=True))

    def load_optimizer_state_dict(self, module: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
        from .optimizers import STATE_CLASSES

        if any(type(v).__name__ in STATE_CLASSES for s in state["state"].values() for v in s.values()):
            return self._low_bit_into_shares(module, optimizer, state)
        load_optimizer_state(module, optimizer, state, options(True, strict=False))

    @staticmethod
    def _low_bit_into_shares(module: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
        """A whole checkpoint's low-bit optimizer states (one process, DDP) into this process's shares:
        each moment re-divided as the one share of one process (optimizers.reshare), the step counters
        as saved. FSDP's own loader cannot split torchao's states, and would replace them with fp32."""
        from . import optimizers

        live = state_dicts().get_optimizer_state_dict(module, optimizer, options=options(False))  # every state made
        shares = {}
        for name, saved in state["state"].items():
            for key, value in saved.items():
                if isinstance(value, Tensor) and value.dim() > 0:
                    shares.update(optimizers.own_share(f"{name}.{key}", value, 0, 1))
                else:
                    live["state"][name][key] = value  # the step counter
        optimizers.reshare(shares, live["state"])
        kept = {n: s for n, s in live["state"].items() if n in state["state"]}
        load_optimizer_state(
            module, optimizer, {"state": kept, "param_groups": state["param_groups"]}, options(False, strict=False)
        )


def load_optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer, state: dict, how) -> None:
    """Optimizer state by parameter name into `optimizer`. AdamW makes a parameter's state at its first
    gradient, so a checkpoint has none for one that never had a gradient; after loading it has none
    either (torch.distributed.checkpoint initialises every parameter's state first), so the resumed run
    takes the same steps as the run that saved it, whichever parameters happened to get gradients."""
    saved = set(state.get("state", {}))
    state_dicts().set_optimizer_state_dict(module, optimizer, state, options=how)
    for name, p in module.named_parameters():
        if p.requires_grad and name not in saved:
            optimizer.state.pop(p, None)


STRATEGIES = {"none": Strategy, "ddp": DDPStrategy, "fsdp": FSDPStrategy}


@dataclass
class Runtime:
    """This process's device and share of the work."""

    device: torch.device
    rank: int = 0
    world_size: int = 1
    strategy: Strategy = field(default_factory=Strategy)
    threads: int = 1  # torch's CPU threads in this process
    collective_timeout_min: float = 10.0  # how long a collective waits for the other ranks
    threads_why: str = ""  # how `threads` was chosen, for the run's header
    deterministic_before: bool | None = None  # torch's setting before train.deterministic changed it
    threads_before: int | None = None  # torch's CPU threads before the run set its own

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1 or dist.is_initialized()

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def broadcast(self, value):
        """Rank 0's value on every rank (any picklable-free plain value: str, int, list, dict)."""
        if not self.distributed:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def mean(self, values: dict[str, float]) -> dict[str, float]:
        """Each value averaged over the ranks."""
        if not self.distributed or not values:
            return values
        keys = sorted(values)
        t = torch.tensor([values[k] for k in keys], dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return {k: float(v) / self.world_size for k, v in zip(keys, t.tolist())}

    def sum_tensor(self, value: Tensor) -> Tensor:
        """A device tensor summed over the ranks (itself in one process); nothing is read back."""
        if self.distributed:
            dist.all_reduce(value)
        return value

    def pooled_mean(self, sums: dict[str, float], count: int) -> dict[str, float]:
        """sum / count, each added up over the ranks first: every rank's batches weigh the same."""
        if self.distributed:
            keys = sorted(sums)
            t = torch.tensor([sums[k] for k in keys] + [count], dtype=torch.float64, device=self.device)
            dist.all_reduce(t)
            *values, count = t.tolist()
            sums = dict(zip(keys, values))
        return {k: v / count for k, v in sums.items()} if count else {}

    @contextlib.contextmanager
    def main_first(self):
        """Rank 0 runs the block first (e.g. fills a cache), then the others."""
        if self.distributed and not self.is_main:
            dist.barrier()
        yield
        if self.distributed and self.is_main:
            dist.barrier()


def resolve_precision(precision: str, device: torch.device) -> str:
    """auto: bf16 autocast on a GPU that supports it (fp32 master weights), fp32 everywhere else
    (a CPU without bf16 hardware only gets slower with it)."""
    if precision != "auto":
        return precision
    return "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "fp32"


def autocast_context(precision: str, device: torch.device):
    """bf16 autocast (fp32 master weights) or nothing."""
    if resolve_precision(precision, device) == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def to_device(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device, non_blocking=True) if isinstance(v, Tensor) else v for k, v in batch.items()}


def pick_device(device: str = "auto", local_rank: int = 0, world: int = 1) -> torch.device:
    """auto: CUDA when there is one, else the CPU; under torchrun each process takes its local GPU."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"device {device!r}: no CUDA device is available here")
    dev = torch.device(device)
    if dev.type == "cuda":
        dev = torch.device("cuda", local_rank if world > 1 else (dev.index or 0))
        torch.cuda.set_device(dev)
        torch.backends.cuda.matmul.allow_tf32 = True  # fp32 matmuls on tensor cores (TF32)
        torch.backends.cudnn.allow_tf32 = True
    return dev


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity, capped by a cgroup CPU quota (a container
    started with --cpus=2 sees every core of the host, but gets two cores' time)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        quota, period = open("/sys/fs/cgroup/cpu.max").read().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return max(1, cores)


def busy_cores(seconds: float = 0.2) -> float:
    """How many cores other programs keep busy now: /proc/stat's non-idle time over a short sleep of
    this process (which therefore adds nothing), 0 where /proc/stat is not there."""

    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        return sum(fields), fields[3] + (fields[4] if len(fields) > 4 else 0)  # total, idle + iowait

    try:
        total0, idle0 = sample()
        time.sleep(seconds)
        total1, idle1 = sample()
    except (OSError, ValueError, IndexError):
        return 0.0
    cores = os.cpu_count() or 1
    return max(0.0, cores * (1 - (idle1 - idle0) / max(1, total1 - total0)))


def choose_threads(threads: int) -> tuple[int, str]:
    """(threads, why): train.threads, or (0) this process's share of the usable cores. Under torchrun
    the processes on this node split them; alone, cores that other programs keep busy are left to
    them: OpenMP threads that wait for a core another job holds make every step crawl (gpt-mini,
    527 tok/s on 2 threads against 4,896 on 1 beside a job using the cores)."""
    if threads > 0:
        return threads, "train.threads"
    usable = usable_cores()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    if local_world > 1:
        return max(1, usable // local_world), f"{usable} usable cores shared by {local_world} processes"
    if usable == 1:  # nothing to choose: no sampling (a short sleep every run would pay)
        return 1, "1 usable core"
    busy = min(busy_cores(), usable)
    chosen = max(1, usable - round(busy))
    return chosen, f"{usable} usable cores" + (f", {busy:.1f} busy with other work" if chosen < usable else "")


def repeatable_kernels() -> bool:
    """train.deterministic: kernels that give the same bits on every run, as Hugging Face's
    full_determinism and torchtitan's debug.deterministic set them. CUDA's fastest kernels sum in an
    order that varies from run to run (attention's backward, atomics), so two identical GPU runs part
    in the last digits within a few steps, and a resumed one cannot follow its uninterrupted run bit
    for bit; the CPU's kernels repeat already. Returns torch's setting before, for teardown."""
    before = torch.are_deterministic_algorithms_enabled()
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS's repeatable workspace
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    return before


def setup_runtime(
    device: str = "auto",
    threads: int = 0,
    strategy: str = "auto",
    collective_timeout_min: float = 10.0,
    deterministic: bool = False,
) -> Runtime:
    """Pick the device and this process's CPU threads; under torchrun (WORLD_SIZE > 1) join the process
    group (nccl on GPU, gloo on CPU) with a timeout on every collective, so that ranks that disagree
    on what to run stop with an error instead of waiting forever."""
    count, why = choose_threads(threads)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    dev = pick_device(device, local, world)
    name = ("ddp" if world > 1 else "none") if strategy == "auto" else strategy
    if name == "none" and world > 1:
        raise UserError(f"train.strategy none runs one process, but torchrun started {world}; use ddp, fsdp or auto")
    strategy_class = STRATEGIES[name]
    if strategy_class.multiprocess and "MASTER_ADDR" not in os.environ:
        raise UserError(
            f"train.strategy {name} runs under torchrun (torchrun --nproc-per-node N -m tfcli ...); "
            "to continue in one process, add --set train.strategy=auto"
        )
    if (world > 1 or strategy_class.multiprocess) and not dist.is_initialized():
        dist.init_process_group(
            "nccl" if dev.type == "cuda" else "gloo", timeout=datetime.timedelta(minutes=collective_timeout_min)
        )
    threads_before = torch.get_num_threads()  # what teardown gives back to a longer process (tests, a notebook)
    torch.set_num_threads(count)
    return Runtime(
        dev,
        rank,
        world,
        strategy_class(),
        threads=count,
        collective_timeout_min=collective_timeout_min,
        threads_why=why,
        deterministic_before=repeatable_kernels() if deterministic else None,
        threads_before=threads_before,
    )


def collective_failure(error: BaseException) -> bool:
    """Whether an error is a collective that timed out or lost its peer (gloo raises RuntimeError,
    NCCL DistBackendError): the ranks no longer agree, and the process group cannot be torn down."""
    text = str(error)
    return isinstance(error, dist.DistError) or (
        isinstance(error, RuntimeError)
        and ("Timed out waiting" in text or "Connection closed by peer" in text or "Connection reset by peer" in text)
    )


def abort_on_collective_failure(rt: Runtime, doing: str, error: BaseException) -> None:
    """A collective that timed out leaves the process group unusable (tearing it down can hang or
    abort): print one line naming this rank, what it was doing and the operation, and exit 2 now."""
    if not (rt.distributed and collective_failure(error)):
        return
    detail = str(error).splitlines()[0].split("] ", 1)[-1][:160] if str(error) else type(error).__name__
    sys.stderr.write(
        f"error: rank {rt.rank} of {rt.world_size}: a collective failed during {doing} ({detail}); "
        f"the processes no longer run the same collectives (train.collective_timeout is "
        f"{rt.collective_timeout_min:g} min)\n"
    )
    sys.stderr.flush()
    os._exit(2)


def teardown(rt: Runtime) -> None:
    if rt.distributed and dist.is_initialized():
        dist.destroy_process_group()
    # a run inside a longer process (tests, a notebook) leaves torch as it was: a thread count left
    # above the process's cores made every later small op wait on threads with no core (100x slower)
    if rt.deterministic_before is not None:
        torch.use_deterministic_algorithms(rt.deterministic_before)
        torch.backends.cudnn.deterministic = rt.deterministic_before
    if rt.threads_before is not None:
        torch.set_num_threads(rt.threads_before)
