"""Checkpoints a crash cannot corrupt, and finding and loading them again.

A run directory:
    config.yaml           the resolved recipe
    tokenizer.json        (text models)
    metrics.jsonl         one JSON line per log interval and per evaluation
    checkpoints/
        step-0000500/     model.safetensors, state.pt (optimizer, schedule, RNG, data position), meta.json
        latest            name of the newest complete checkpoint
        best              name of the best one (finetuning)

A checkpoint is written into a temporary directory and renamed into place only when complete;
`latest` is then replaced atomically, so it always names a whole checkpoint.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import time
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from .errors import UserError

CHECKPOINTS = "checkpoints"
WEIGHTS = "model.safetensors"
STATE = "state.pt"
META = "meta.json"


def _write_atomic(path: Path, text: str) -> None:
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


def save(run_dir: Path, step: int, weights: dict[str, torch.Tensor], state: dict, meta: dict, keep: int,
         best: bool = False) -> Path:
    """Write checkpoint `step`, point `latest` (and `best`) at it, prune old ones beyond `keep`."""
    root = Path(run_dir) / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    name = f"step-{step:07d}"
    tmp = root / f".{name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    weights = {k: v.detach().contiguous().cpu() for k, v in weights.items()}
    save_file(_untie(weights), str(tmp / WEIGHTS))
    torch.save(state, tmp / STATE)
    (tmp / META).write_text(json.dumps({"step": step, "time": time.time(), **meta}, indent=2))
    final = root / name
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    _write_atomic(root / "latest", name)
    if best:
        _write_atomic(root / "best", name)
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
    protected = {_read(root / "latest"), _read(root / "best")}
    steps = sorted(p for p in root.glob("step-*") if p.is_dir())
    for p in steps[: max(0, len(steps) - keep)]:
        if p.name not in protected:
            shutil.rmtree(p, ignore_errors=True)


def _read(path: Path) -> Optional[str]:
    return path.read_text().strip() if path.is_file() else None


def find(path: Path, which: str = "latest") -> Path:
    """A checkpoint directory from a run directory (its latest or best) or a checkpoint directory."""
    path = Path(path)
    if (path / WEIGHTS).is_file():
        return path
    root = path / CHECKPOINTS
    name = _read(root / which) or _read(root / "latest")
    if not path.is_dir():
        raise UserError(f"checkpoint not found: {path}")
    if not name or not (root / name / WEIGHTS).is_file():
        raise UserError(f"{path} holds no complete checkpoint")
    return root / name


def run_dir_of(ckpt: Path) -> Path:
    """The run directory a checkpoint directory belongs to."""
    ckpt = Path(ckpt)
    return ckpt.parent.parent if ckpt.parent.name == CHECKPOINTS else ckpt


def newest_run(runs_root: Path = Path("runs")) -> Path:
    """The most recently written run under runs/ that has a checkpoint (generate's default)."""
    candidates = [p for p in Path(runs_root).glob("*/") if (p / CHECKPOINTS / "latest").is_file()]
    if not candidates:
        raise UserError(f"no runs with a checkpoint under {runs_root}/; pass --checkpoint")
    return max(candidates, key=lambda p: (p / CHECKPOINTS / "latest").stat().st_mtime)


def load_weights(ckpt: Path) -> dict[str, torch.Tensor]:
    return load_file(str(Path(ckpt) / WEIGHTS))


def load_state(ckpt: Path) -> dict:
    return torch.load(Path(ckpt) / STATE, weights_only=False)


def read_meta(ckpt: Path) -> dict:
    return json.loads((Path(ckpt) / META).read_text())
