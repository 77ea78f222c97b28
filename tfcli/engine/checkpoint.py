"""Checkpoints a crash cannot corrupt and a stranger cannot booby-trap, and finding them again.

A run directory:
    config.yaml           the resolved recipe
    tokenizer.json        (text models)
    metrics.jsonl         one JSON line per log interval and per evaluation
    checkpoints/
        step-0000500/     model.safetensors, state.safetensors + state.json (optimizer, schedule,
                          RNG, data position), meta.json; an FSDP run's: shards/ (each process's
                          weights and optimizer states, engine/shards.py) instead of the whole weights
        latest            name of the newest complete checkpoint
        best              name of the best one (finetuning)
    .lock                 the process writing the run (pid@host), while it runs

Nothing here unpickles: tensors go to safetensors, everything else to JSON, so loading a checkpoint
cannot run code. A checkpoint is written into a temporary directory and renamed into place only
when complete; `latest` is then replaced atomically, so it always names a whole checkpoint. A
failed write (a full disk) removes its temporary directory and leaves `latest` as it was.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import socket
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from ..errors import UserError
from . import shards

CHECKPOINTS = "checkpoints"
WEIGHTS = "model.safetensors"
STATE_TENSORS = "state.safetensors"
STATE = "state.json"
META = "meta.json"
LEGACY_STATE = "state.pt"  # pickled state of tfcli < 0.2: refused, see upgrade_legacy
FILES = (WEIGHTS, STATE_TENSORS, STATE, META)
LOCK = ".lock"


def write_atomic(path: Path, text: str) -> None:
    """Replace a file whole: a reader (another rank resuming the run) sees the old text or the new,
    never a truncated file."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# --- state as safetensors + JSON -----------------------------------------------------------------


def _encode(obj: Any, tensors: dict[str, torch.Tensor], stored: set[int]) -> Any:
    """A nested state (dicts with int or str keys, tuples, tensors, arrays, scalars) -> JSON data,
    its tensors and arrays moved into `tensors`. A tensor on the CPU is written from where it is (a
    copy of the optimizer's moments, twice the weights, would raise the run's peak at every save);
    one sharing storage with a tensor stored before it is copied (safetensors refuses shared storage)."""
    if isinstance(obj, torch.Tensor):
        key = f"t{len(tensors)}"
        t = obj.detach().cpu().contiguous()
        storage = t.untyped_storage().data_ptr()
        tensors[key] = t.clone() if storage in stored and t.numel() else t
        stored.add(storage)
        return {"__tensor__": key}
    if isinstance(obj, np.ndarray):
        key = f"t{len(tensors)}"
        tensors[key] = torch.from_numpy(
            np.ascontiguousarray(obj).astype(np.int64 if obj.dtype.kind in "ui" else obj.dtype)
        )
        return {"__ndarray__": key, "dtype": str(obj.dtype)}
    if isinstance(obj, dict):
        return {"__dict__": [[k, _encode(v, tensors, stored)] for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {"__tuple__": [_encode(v, tensors, stored) for v in obj]}
    if isinstance(obj, list):
        return [_encode(v, tensors, stored) for v in obj]
    if isinstance(obj, np.generic):
        return obj.item()
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"cannot store {type(obj).__name__} in a checkpoint")


def _decode(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, list):
        return [_decode(v, tensors) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if "__tensor__" in obj:
        return tensors[obj["__tensor__"]]
    if "__ndarray__" in obj:
        return tensors[obj["__ndarray__"]].numpy().astype(obj["dtype"])
    if "__tuple__" in obj:
        return tuple(_decode(v, tensors) for v in obj["__tuple__"])
    return {k: _decode(v, tensors) for k, v in obj["__dict__"]}


def write_state(directory: Path, state: dict) -> None:
    tensors: dict[str, torch.Tensor] = {}
    tree = _encode(state, tensors, set())
    save_file(tensors, str(Path(directory) / STATE_TENSORS))
    (Path(directory) / STATE).write_text(json.dumps(tree))


def load_state(ckpt: Path) -> dict:
    """Optimizer, schedule, RNG and data position of a checkpoint; no code can run."""
    ckpt = Path(ckpt)
    if (ckpt / LEGACY_STATE).is_file() and not (ckpt / STATE).is_file():
        raise UserError(
            f"{ckpt / LEGACY_STATE} is a pickle, which tfcli does not load (it can run code); if you "
            f"trust it, convert it with `tfcli upgrade {run_dir_of(ckpt)}`"
        )
    try:
        return _decode(json.loads((ckpt / STATE).read_text()), load_file(str(ckpt / STATE_TENSORS)))
    except (OSError, SafetensorError, json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise UserError(f"{ckpt}: unreadable training state ({_first_line(e)})") from None


# --- writing ------------------------------------------------------------------------------------


def staging(run_dir: Path, step: int, create: bool = True) -> Path:
    """The temporary directory checkpoint `step` is written into (made empty when `create`)."""
    root = Path(run_dir) / CHECKPOINTS
    tmp = root / f".step-{step:07d}.tmp"
    if create:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    return tmp


def save(
    run_dir: Path,
    step: int,
    weights: dict[str, torch.Tensor] | None,
    state: dict,
    meta: dict,
    keep: int,
    best: bool = False,
    staged: bool = False,
) -> Path:
    """Write checkpoint `step`, point `latest` (and `best`) at it, prune old ones beyond `keep`.
    staged: the processes have written their shards into staging() already (weights None).
    A failed write (no space left, say) removes its temporary files and leaves `latest` as it was."""
    root = Path(run_dir) / CHECKPOINTS
    name = f"step-{step:07d}"
    try:
        tmp = staging(run_dir, step, create=not staged)
        if weights is not None:
            save_file(_untie({k: v.detach().contiguous().cpu() for k, v in weights.items()}), str(tmp / WEIGHTS))
        write_state(tmp, state)
        (tmp / META).write_text(json.dumps({"step": step, "time": time.time(), **meta}, indent=2))
        final = root / name
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        write_atomic(root / "latest", name)
        if best:
            write_atomic(root / "best", name)
    except (OSError, SafetensorError) as e:  # safetensors reports a full disk as its own error
        shutil.rmtree(staging(run_dir, step, create=False), ignore_errors=True)
        previous = read_pointer(root / "latest")
        reason = getattr(e, "strerror", None) or _first_line(e).split("I/O error: ")[-1]
        raise UserError(
            f"could not write checkpoint {name} in {root} ({reason}); "
            + (f"latest is still {previous}" if previous else "no checkpoint was kept")
        ) from None
    _prune(root, keep)
    return final


def _untie(weights: dict) -> dict:
    """safetensors refuses shared storage (tied embeddings): give each name its own copy."""
    seen: dict[int, str] = {}
    out = {}
    for k, v in weights.items():
        ptr = v.untyped_storage().data_ptr()
        out[k] = v.clone() if ptr in seen else v
        seen.setdefault(ptr, k)
    return out


def _prune(root: Path, keep: int) -> None:
    protected = {read_pointer(root / "latest"), read_pointer(root / "best")}
    steps = sorted(p for p in root.glob("step-*") if p.is_dir())
    for p in steps[: max(0, len(steps) - keep)]:
        if p.name not in protected:
            shutil.rmtree(p, ignore_errors=True)


def read_pointer(path: Path) -> str | None:
    """What a pointer file (latest, best, .lock) names; None when there is none."""
    return path.read_text().strip() if path.is_file() else None


def _first_line(e: Exception) -> str:
    lines = str(e).strip().splitlines()
    return lines[0][:200] if lines else e.__class__.__name__


# --- finding and reading ---------------------------------------------------------------------------


def has_weights(ckpt: Path) -> bool:
    """Whether a directory is a checkpoint's: whole weights, or an FSDP run's shards."""
    return (Path(ckpt) / WEIGHTS).is_file() or shards.is_sharded(ckpt)


def find(path: Path, which: str = "latest") -> Path:
    """A checkpoint directory from a run directory (its latest or best) or a checkpoint directory."""
    path = Path(path)
    if has_weights(path):
        return path
    if not path.is_dir():
        raise UserError(f"checkpoint not found: {path}")
    root = path / CHECKPOINTS
    name = read_pointer(root / which) or read_pointer(root / "latest")
    if not name or not has_weights(root / name):
        raise UserError(f"{path} holds no complete checkpoint")
    return root / name


def chosen(path: Path, ckpt: Path) -> str:
    """Every command that reads a run takes its best checkpoint, or its latest when it keeps no best:
    where the two differ, which one it read, in words ("" otherwise, and when `path` named the
    checkpoint itself)."""
    root = Path(path) / CHECKPOINTS
    if Path(path) == Path(ckpt) or not root.is_dir():
        return ""
    best, latest = read_pointer(root / "best"), read_pointer(root / "latest")
    if best is None or best == latest:
        return ""
    return f"reading {ckpt.name}, the best checkpoint of {path} (its latest is {latest})"


def tensor_file_bytes(ckpt: Path) -> int:
    """The bytes of a checkpoint's tensors (weights and optimizer states; an FSDP run's shards): what
    resuming from it reads into memory."""
    return sum(p.stat().st_size for p in Path(ckpt).rglob("*.safetensors"))


def verify(ckpt: Path, training_state: bool = True) -> None:
    """Every file of a checkpoint present and readable (safetensors headers, JSON): checked before a
    run that resumes from it writes anything."""
    ckpt = Path(ckpt)
    if training_state and (ckpt / LEGACY_STATE).is_file() and not (ckpt / STATE).is_file():
        load_state(ckpt)  # the one-line refusal naming the conversion
    sharded = shards.is_sharded(ckpt)
    weights = () if sharded else (WEIGHTS,)
    for name in (*weights, STATE_TENSORS, STATE, META) if training_state else (*weights, META):
        if not (ckpt / name).is_file():
            raise UserError(f"{ckpt}: {name} is missing; the checkpoint is incomplete")
    if sharded:
        shards.sizes(ckpt)  # every shard's header readable
    try:
        for name in (*weights, STATE_TENSORS) if training_state else weights:
            with safe_open(str(ckpt / name), "pt") as f:
                f.keys()
        for name in (STATE, META) if training_state else (META,):
            json.loads((ckpt / name).read_text())
    except (SafetensorError, OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{ckpt / name}: unreadable ({_first_line(e)})") from None


def run_dir_of(ckpt: Path) -> Path:
    """The run directory a checkpoint directory belongs to."""
    ckpt = Path(ckpt)
    return ckpt.parent.parent if ckpt.parent.name == CHECKPOINTS else ckpt


def newest_run(runs_root: Path = Path("runs"), families: tuple[str, ...] = ()) -> Path:
    """The most recently written run under runs/ that has a checkpoint (the default --checkpoint),
    of one of `families` when given (generate: a run that can generate, not a newer BERT's)."""
    candidates = [
        p
        for p in Path(runs_root).glob("*/")
        if (p / CHECKPOINTS / "latest").is_file() and (not families or _family(p) in families)
    ]
    if not candidates:
        kind = f" of a {' or '.join(families)} model" if families else ""
        raise UserError(f"no runs{kind} with a checkpoint under {runs_root}/; pass --checkpoint")
    return max(candidates, key=lambda p: (p / CHECKPOINTS / "latest").stat().st_mtime)


def _family(run: Path) -> str | None:
    """The model family a run's config.yaml names (None when unreadable)."""
    import yaml

    try:
        return (yaml.safe_load((run / "config.yaml").read_text()) or {}).get("model", {}).get("family")
    except (OSError, yaml.YAMLError, AttributeError):
        return None


def load_weights(ckpt: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's whole weights (an FSDP run's shards consolidated)."""
    if shards.is_sharded(ckpt):
        return shards.consolidated(ckpt)
    try:
        return load_file(str(Path(ckpt) / WEIGHTS))
    except (SafetensorError, OSError) as e:
        raise UserError(f"{Path(ckpt) / WEIGHTS}: unreadable ({_first_line(e)})") from None


def read_meta(ckpt: Path) -> dict:
    try:
        return json.loads((Path(ckpt) / META).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"{Path(ckpt) / META}: unreadable ({_first_line(e)})") from None


# --- one writer per run -----------------------------------------------------------------------------


@contextlib.contextmanager
def lock(run_dir: Path):
    """Hold RUN/.lock while writing a run: a second process writing the same run is refused; a lock
    left by a process that died (same host, pid gone) is taken over."""
    path = Path(run_dir) / LOCK
    me = f"{os.getpid()}@{socket.gethostname()}"
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            break
        except FileExistsError:
            holder = read_pointer(path) or ""
            if _alive(holder):
                raise UserError(f"{run_dir} is being written by process {holder}; wait for it, or stop it") from None
            path.unlink(missing_ok=True)  # a dead process's lock
    else:
        raise UserError(f"{run_dir}: could not take {LOCK}")
    os.write(fd, me.encode())
    os.close(fd)
    try:
        yield
    finally:
        if read_pointer(path) == me:
            path.unlink(missing_ok=True)


def _alive(holder: str) -> bool:
    pid, _, host = holder.partition("@")
    if host != socket.gethostname() or not pid.isdigit():
        return bool(holder) and host != socket.gethostname()  # another machine's lock: respect it
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# --- converting old checkpoints ---------------------------------------------------------------------


def upgrade_legacy(run_dir: Path) -> list[Path]:
    """Rewrite every pickled state.pt of a run as state.safetensors + state.json. The pickle is read
    with torch's weights_only loader and an allow-list of the numpy types tfcli's old RNG state used,
    so a pickle carrying code is refused, not run."""
    done = []
    for pt in sorted(Path(run_dir).glob(f"{CHECKPOINTS}/step-*/{LEGACY_STATE}")):
        from numpy._core.multiarray import _reconstruct

        allowed = [
            np.ndarray,
            np.dtype,
            type(np.dtype(np.uint32)),
            _reconstruct,
        ]  # what np.random.get_state() pickles to
        try:
            with torch.serialization.safe_globals(allowed), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # torch's note on the pickle protocol: the refusal below says it all
                state = torch.load(pt, map_location="cpu", weights_only=True)
        except Exception as e:  # the weights_only unpickler refuses anything it does not allow
            raise UserError(f"{pt}: refused by the weights_only loader ({_first_line(e)})") from None
        write_state(pt.parent, state)
        pt.unlink()
        done.append(pt.parent)
    return done
