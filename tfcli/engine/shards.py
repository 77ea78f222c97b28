"""Sharded checkpoints: an FSDP run saves with torch.distributed.checkpoint, each process writing its
own shards, and any number of processes (one included) reads them back, DCP resharding as it loads.

The storage is DCP's Hugging Face layout (HuggingFaceStorageWriter/Reader): one safetensors file per
process, each tensor's offsets in its header as JSON. DCP's default FileSystemReader unpickles its
`.metadata` file; this one reads only safetensors headers, so a checkpoint still cannot run code.
The model's weights keep their checkpoint names (model.*, heads.*); the optimizer's tensors are
`optim.<parameter>.<state>`; what is not a tensor (the optimizer's param_groups) goes to state.json.

DCP's Hugging Face reader takes whatever safetensors files it finds: with one process's file gone it
reads the others and leaves the missing rows as uninitialised memory. So rank 0 lists every file and
its size in shards/index.json once all are written, and `check` holds a checkpoint to it, and every
tensor's saved pieces to its whole shape, before anything is read.
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..errors import UserError
from . import optimizers
from .runtime import options, state_dicts

SHARDS = "shards"  # the checkpoint's directory of per-process safetensors files
INDEX = "index.json"  # in SHARDS: every process's file and its size in bytes, written when all are whole
OPTIM = "optim."  # the prefix of the optimizer's tensors
ONE_PROCESS = ".*assuming the intent is to (load|save) in a single process.*"  # DCP's note: what it is asked


def _dcp():
    """torch.distributed.checkpoint, imported when shards are first written or read (the import is slow)."""
    import torch.distributed.checkpoint as dcp

    return dcp


def is_sharded(ckpt: Path) -> bool:
    return (Path(ckpt) / SHARDS).is_dir()


def _optimizer_tensors(optim: dict, optimizer) -> dict[str, Tensor]:
    """The optimizer's tensors by checkpoint name: AdamW's moments as DTensors (DCP reshards them), a
    low-bit optimizer's as each process's own share (optimizers.own_share)."""
    low_bit = not isinstance(optimizer, torch.optim.AdamW)
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    out = {}
    for name, state in optim["state"].items():
        for key, value in state.items():
            if not isinstance(value, Tensor):
                continue
            if low_bit and value.dim() > 0:  # a moment (the step counters are 0-d, the same everywhere)
                out.update(optimizers.own_share(f"{OPTIM}{name}.{key}", value, rank, world))
            else:
                out[f"{OPTIM}{name}.{key}"] = value
    return out


def _other_counts_shares(meta: dict, stored: dict[str, Tensor]) -> dict[str, Tensor]:
    """The shares another number of processes saved of the low-bit states this process wants (its own
    share's names are absent): an empty tensor for each, to be read and re-divided (optimizers.reshare)."""
    wanted = {k.split("@")[0] for k in stored if "@" in k and k not in meta}
    return {
        k: torch.empty(m.size, dtype=m.properties.dtype)
        for k, m in meta.items()
        if k.split("@")[0] in wanted and "@" in k
    }


def save(directory: Path, module: nn.Module, optimizer, names: set | None) -> list:
    """Every process writes its shards of the weights (`names` only, for a run that saves what it trains)
    and of the optimizer's states into directory/shards; returns the optimizer's param_groups (JSON)."""
    weights = state_dicts().get_model_state_dict(module, options=options(False))
    if names is not None:
        weights = {k: v for k, v in weights.items() if k in names}
    optim = state_dicts().get_optimizer_state_dict(module, optimizer, options=options(False))
    dcp = _dcp()
    writer = dcp.HuggingFaceStorageWriter(str(Path(directory) / SHARDS), save_distributed=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=ONE_PROCESS)
        dcp.save(
            {**weights, **_optimizer_tensors(optim, optimizer)},
            storage_writer=writer,
            no_dist=not dist.is_initialized(),
        )
    return optim["param_groups"]


def write_index(directory: Path) -> None:
    """Rank 0, once every process has written its file: each file's name and size (shards/index.json)."""
    folder = Path(directory) / SHARDS
    files = {p.name: p.stat().st_size for p in sorted(folder.glob("*.safetensors"))}
    (folder / INDEX).write_text(json.dumps({"files": files}, indent=1))


def check_files(ckpt: Path) -> None:
    """The files a sharded checkpoint must hold, before any is read: a DCP checkpoint in torch's own
    format (its .metadata is a pickle, which tfcli never reads) is refused; every file index.json lists
    must be there at its size, and no other."""
    folder = Path(ckpt) / SHARDS
    if (folder / ".metadata").exists() or any(folder.glob("*.distcp")):
        raise UserError(
            f"{folder}: a torch.distributed.checkpoint in its own format (a pickled .metadata), which tfcli "
            f"never reads (unpickling can run code); tfcli's shards are safetensors files"
        )
    present = {p.name: p.stat().st_size for p in folder.glob("*.safetensors")}
    if not (folder / INDEX).is_file():
        if not present:
            raise UserError(f"{folder}: no shard files (safetensors) in it; the checkpoint is incomplete")
        return  # written before index.json: only the pieces' coverage is checked (_metadata)
    try:
        listed = json.loads((folder / INDEX).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"{folder / INDEX}: unreadable ({type(e).__name__})") from None
    for name, size in listed.items():
        if name not in present:
            raise UserError(
                f"{folder}: {name} is missing ({len(listed)} shard files listed); the checkpoint is incomplete"
            )
        if present[name] != size:
            raise UserError(f"{folder / name}: {present[name]:,} bytes, {size:,} when written; the file is damaged")
    extra = sorted(set(present) - set(listed))
    if extra:
        raise UserError(f"{folder}: {extra[0]} is not one of the checkpoint's shard files (index.json); remove it")


def _metadata(ckpt: Path) -> dict:
    """Every tensor's metadata (whole shape, dtype), from the files' headers, once the files are all
    there (check_files) and every tensor's pieces cover its whole shape."""
    check_files(ckpt)
    try:
        meta = _dcp().HuggingFaceStorageReader(str(Path(ckpt) / SHARDS)).read_metadata().state_dict_metadata
    except Exception as e:  # a truncated or foreign file: safetensors' own error
        raise UserError(f"{Path(ckpt) / SHARDS}: unreadable ({str(e).splitlines()[0][:160]})") from None
    for key, m in meta.items():
        held = sum(math.prod(c.sizes) for c in m.chunks)
        if held != math.prod(m.size):
            raise UserError(
                f"{Path(ckpt) / SHARDS}: {key} has {held:,} of its {math.prod(m.size):,} values in the shard "
                f"files (a process's file is missing); the checkpoint is incomplete"
            )
    return meta


def sizes(ckpt: Path) -> dict[str, tuple]:
    """Every tensor's whole (unsharded) shape."""
    return {k: tuple(m.size) for k, m in _metadata(ckpt).items()}


def load(ckpt: Path, module: nn.Module, optimizer, param_groups: list, names: set | None) -> None:
    """The checkpoint's weights and optimizer states into this process's module and optimizer (sharded
    or whole, on any number of processes; a low-bit optimizer's states saved by another number are
    re-divided: optimizers.reshare). A parameter with no state in the checkpoint (it never had a
    gradient) gets none, as in the run that saved it."""
    from .runtime import load_optimizer_state

    meta = _metadata(ckpt)
    weights = state_dicts().get_model_state_dict(module, options=options(False))
    if names is not None:
        weights = {k: v for k, v in weights.items() if k in names}
    optim = state_dicts().get_optimizer_state_dict(
        module, optimizer, options=options(False)
    )  # every state made, to be filled
    stored = _optimizer_tensors(optim, optimizer)
    moments = {k: v for k, v in stored.items() if k in meta}
    others = _other_counts_shares(meta, stored)
    dcp = _dcp()
    reader = dcp.HuggingFaceStorageReader(str(Path(ckpt) / SHARDS))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=ONE_PROCESS)
        dcp.load({**weights, **moments, **others}, storage_reader=reader, no_dist=not dist.is_initialized())
    optimizers.reshare({k.removeprefix(OPTIM): t for k, t in others.items()}, optim["state"])
    state_dicts().set_model_state_dict(module, weights, options=options(False, strict=names is None))
    # optim.<parameter>.<state>[@<share>...]: the parameters the checkpoint holds states of
    kept = {k.removeprefix(OPTIM).partition("@")[0].rpartition(".")[0] for k in (*moments, *others)}
    state = {"state": {n: s for n, s in optim["state"].items() if n in kept}, "param_groups": param_groups}
    load_optimizer_state(module, optimizer, state, options(False, strict=False))


def consolidated(ckpt: Path) -> dict[str, Tensor]:
    """The whole weights of a sharded checkpoint, read in this process alone (export, eval, generate)."""
    weights = {
        k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in _metadata(ckpt).items() if not k.startswith(OPTIM)
    }
    dcp = _dcp()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=ONE_PROCESS)
        dcp.load(weights, storage_reader=dcp.HuggingFaceStorageReader(str(Path(ckpt) / SHARDS)), no_dist=True)
    return weights
