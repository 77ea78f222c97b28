"""The optimizer a run trains with (optim.name): PyTorch's fused AdamW, or torchao's AdamW with its
moments kept in 8 or 4 bits (block-wise quantized, dynamic-tree / linear maps), which store the two
moments in about a quarter (8-bit) or an eighth (4-bit) of fp32's memory.

torchao is the field's kept implementation (torchtune's and torchtitan's choice); it runs on CPU and
CUDA and under FSDP2, and offers 4-bit moments too (bitsandbytes 0.50's 8-bit AdamW also runs on the
CPU; it has no 4-bit one). Its states are tensor subclasses:
a checkpoint stores their plain parts (codes, scales, the quantization map) and rebuilds them on
resume, so nothing is pickled and the resumed run continues bit for bit.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

from ..errors import UserError
from ..models.nf4 import quiet_torchao

LOW_BIT = {"adamw8bit": "AdamW8bit", "adamw4bit": "AdamW4bit"}
STATE_CLASSES = {"OptimState8bit": "subclass_8bit", "OptimState4bit": "subclass_4bit"}  # what a checkpoint rebuilds


def torchao_optim():
    try:
        return quiet_torchao("torchao.optim")
    except ImportError:
        raise UserError("optim.name adamw8bit/adamw4bit needs torchao (pip install torchao)") from None


def build(groups: list[dict], o) -> torch.optim.Optimizer:
    """groups: decay_groups' parameter groups; o: the recipe's optim section."""
    if o.name == "adamw":
        return torch.optim.AdamW(groups, lr=o.lr, betas=o.betas, eps=o.eps, fused=True)
    # the compiled step's note to torchao's developers, not to a user: said once per state class
    warnings.filterwarnings("ignore", message=".*does not implement _stable_hash_for_caching.*")
    return getattr(torchao_optim(), LOW_BIT[o.name])(groups, lr=o.lr, betas=o.betas, eps=o.eps)


def for_unequal_shares(module: torch.nn.Module, world: int) -> bool:
    """Under FSDP, when a trained parameter's rows do not split evenly over the processes (GPT-2's
    50,257 tokens over 2), its shares differ in shape from process to process, and torchao's compiled
    step, read back from inductor's on-disk graph cache, can be another process's (a size assertion
    fails at the first step; seen with torch 2.13): this process compiles its own instead. Returns
    whether it had to."""
    if not any(p.requires_grad and p.shape[0] % world for p in module.parameters()):
        return False
    import torch._inductor.config as inductor

    inductor.fx_graph_cache = False
    return True


def step(opt: torch.optim.Optimizer, found_inf: Tensor) -> None:
    """One optimizer step, skipped when found_inf is 1: the fused AdamW skips on the device (nothing read
    back); torchao's optimizers do not read found_inf, so the flag is read back first."""
    if isinstance(opt, torch.optim.AdamW):
        opt.found_inf = found_inf
        opt.step()
    elif not bool(found_inf):
        opt.step()


def state_bytes(opt: torch.optim.Optimizer) -> int:
    """The memory the optimizer's states hold (the moments, their scales and maps)."""
    total = 0
    for state in opt.state.values():
        for value in state.values():
            if isinstance(value, Tensor):
                total += sum(t.numel() * t.element_size() for t in _parts(value).values())
    return total


def plain(state):
    """An optimizer state dict with each low-bit moment as {"__lowbit__": class, parts..., ctx}: plain
    tensors and JSON values a checkpoint stores."""
    if isinstance(state, dict):
        return {k: plain(v) for k, v in state.items()}
    if isinstance(state, list):
        return [plain(v) for v in state]
    if isinstance(state, Tensor) and type(state).__name__ in STATE_CLASSES:
        names, ctx = state.__tensor_flatten__()
        return {
            "__lowbit__": type(state).__name__,
            "parts": {n: getattr(state, n) for n in names},
            "ctx": [_ctx_value(c) for c in ctx],
            "shape": list(state.shape),
            "stride": list(state.stride()),
        }
    return state


def rebuilt(state):
    """plain()'s inverse: only torchao's two state classes are rebuilt, from tensors and plain values."""
    if isinstance(state, dict) and "__lowbit__" in state:
        name = state["__lowbit__"]
        if name not in STATE_CLASSES:
            raise UserError(f"the checkpoint's optimizer holds {name!r}, which tfcli does not rebuild")
        module = __import__(f"torchao.optim.{STATE_CLASSES[name]}", fromlist=[name])
        ctx = [_ctx_from(c) for c in state["ctx"]]
        return getattr(module, name).__tensor_unflatten__(
            dict(state["parts"]), ctx, torch.Size(state["shape"]), tuple(state["stride"])
        )
    if isinstance(state, dict):
        return {k: rebuilt(v) for k, v in state.items()}
    if isinstance(state, list):
        return [rebuilt(v) for v in state]
    return state


def own_share(name: str, state: Tensor, rank: int, world: int) -> dict[str, Tensor]:
    """This process's share of a low-bit optimizer's moment under names that say which of how many it
    is (name@0of2.codes, name@0of2.scale, ... when quantized; name@0of2 for an fp32 one): the live
    tensors, which a checkpoint fills in place on load. torch.distributed.checkpoint cannot reshard a
    moment quantized in blocks of each process's share: the same number of processes reads the
    shares back as they are, another re-divides them (reshare)."""
    local = state.to_local() if hasattr(state, "to_local") else state
    return {f"{name}@{rank}of{world}" + (f".{part}" if part else ""): t for part, t in _parts(local).items()}


def reshare(shares: dict[str, Tensor], states: dict) -> None:
    """Each state another number of processes saved ({"<param>.<state>@<rank>of<n>[.<part>]": tensor}),
    rebuilt whole from its shares (dequantized, in rank order: FSDP shards by rows) and this process's
    rows written into its own state in `states` ({param: {state: tensor}}), quantized in its own
    blocks. Not bit for bit (the blocks differ), which no resharding of block-quantized moments is."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    by_state: dict[str, dict[int, dict[str, Tensor]]] = {}
    for k, t in shares.items():
        name, _, rest = k.partition("@")
        share, _, part = rest.partition(".")
        by_state.setdefault(name, {}).setdefault(int(share.partition("of")[0]), {})[part] = t
    for name, ranked in by_state.items():
        param, _, key = name.rpartition(".")
        target = states[param][key]
        whole = torch.cat([dequantized_share(ranked[r]) for r in sorted(ranked)]).view(target.shape)
        if isinstance(target, DTensor):
            chunks = torch.chunk(whole, dist.get_world_size(), dim=0)  # FSDP2's rows; the last ranks may get none
            rank = dist.get_rank()
            target.to_local().copy_(chunks[rank] if rank < len(chunks) else whole[:0])
        else:
            target.copy_(whole)


def dequantized_share(parts: dict[str, Tensor]) -> Tensor:
    """One saved share of a state (own_share's parts), flat, in fp32: a plain share as it is, a low-bit
    one dequantized by torchao's own class (8-bit: a 256-entry map; 4-bit: 16 entries, codes packed in
    pairs; a map with negative entries is the signed first moment's)."""
    if "" in parts:
        return parts[""].reshape(-1).float()
    codes, scale, qmap = parts["codes"], parts["scale"], parts["qmap"]
    signed = bool(qmap.min() < 0)
    if qmap.numel() == 256:
        from torchao.optim.subclass_8bit import OptimState8bit

        state = OptimState8bit(codes, scale, qmap, signed)
    else:
        from torchao.optim.subclass_4bit import OptimState4bit

        state = OptimState4bit(codes, scale, qmap, signed, torch.Size([codes.numel() * 2]))
    return state.dequantize().reshape(-1)


def _parts(t: Tensor) -> dict[str, Tensor]:
    if type(t).__name__ in STATE_CLASSES:
        return {n: getattr(t, n) for n in t.__tensor_flatten__()[0]}
    return {"": t}


def _ctx_value(c):
    if isinstance(c, torch.dtype):
        return {"__dtype__": str(c).removeprefix("torch.")}
    if isinstance(c, torch.Size):
        return {"__size__": list(c)}
    return c


def _ctx_from(c):
    if isinstance(c, dict) and "__dtype__" in c:
        return getattr(torch, c["__dtype__"])
    if isinstance(c, dict) and "__size__" in c:
        return torch.Size(c["__size__"])
    return c
