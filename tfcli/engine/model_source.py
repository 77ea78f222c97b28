"""What `--from` and `--checkpoint` name, worked out once, at the edge: a tfcli run or one of its
checkpoints, a Hugging Face directory, a GGUF file, or a hub id (read from the local Hugging Face
cache, or downloaded). The driver, the commands and the loaders take the ModelSource this returns;
no other module tests what a path is.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from .. import recipe as recipes
from ..errors import UserError
from ..hf import convert, gguf, hub, interop
from . import checkpoint

RUN = "run"  # a tfcli run directory, or one of its checkpoint directories
HF = "hf"  # a transformers directory (config.json and weights)
GGUF = "gguf"  # a GGUF file (llama.cpp's format)
KINDS = (RUN, HF, GGUF)

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")  # 'gpt2', 'google-t5/t5-small'


@dataclass(frozen=True)
class ModelSource:
    """A model on disk and what it is. `family` and `config` read only the source's config (a run's
    config.yaml, a directory's config.json, a GGUF file's header), once."""

    kind: str  # one of KINDS
    path: Path  # where it is (a hub id: its snapshot directory in the cache)
    whole: bool = True  # RUN: False when it is only read as a run so that what is wrong with it is named

    @property
    def is_run(self) -> bool:
        return self.kind == RUN

    @property
    def is_gguf(self) -> bool:
        return self.kind == GGUF

    @property
    def run_dir(self) -> Path | None:
        """A run's directory (of a checkpoint: the run it belongs to)."""
        return checkpoint.run_dir_of(self.path) if self.is_run else None

    @property
    def transformers_can_name(self) -> bool:
        """Whether transformers' from_pretrained reads it as it is (a PEFT adapter can name it as its base)."""
        return self.kind == HF

    @cached_property
    def config(self) -> Any:
        """A run's resolved recipe; the transformers config (a dict) of a directory or a GGUF file."""
        if self.is_run:
            return recipes.load_resolved(self.run_dir / "config.yaml")
        return gguf.read_config(self.path) if self.is_gguf else convert.read_config(self.path)

    @property
    def raw_config(self) -> dict | None:
        """A directory's parsed config.json, which the loaders take rather than reading it again (None
        for a run or a GGUF file, whose loaders read their own)."""
        return self.config if self.kind == HF else None

    @cached_property
    def record(self):
        """The architecture record (hf/record.py) of a directory or GGUF file; None for a run."""
        return None if self.is_run else interop.record_of_config(self.config, self.path)

    @cached_property
    def family(self) -> str:
        """The tfcli model family it holds (refused in one line when tfcli has none for it)."""
        if self.is_run:
            return self.config.model.family
        return self.record.family

    def __str__(self) -> str:
        return str(self.path)


def local(path: str | Path | None) -> ModelSource | None:
    """What a local path holds, or None when it is not there or holds no model tfcli reads."""
    if path is None or str(path) == "" or not Path(path).exists():
        return None
    path = Path(path)
    if _is_run(path):
        return ModelSource(RUN, path)
    if _looks_like_run(path):
        return ModelSource(RUN, path, whole=False)
    if path.is_file() and path.suffix.lower() == gguf.SUFFIX:
        return ModelSource(GGUF, path)
    if (path / convert.CONFIG).is_file():
        return ModelSource(HF, path)
    return None


def resolve(name: str | Path, flag: str = "--from") -> ModelSource:
    """What `flag NAME` names: a local run, directory or GGUF file, else a hub id's snapshot (cache
    first, then the hub); anything else refused in one line."""
    text = str(name)
    if not Path(text).exists() and _looks_like_hub_id(text):
        found = local(hub.snapshot(text, flag))
    elif not Path(text).exists():
        raise UserError(f"{flag} {text}: not found")
    else:
        found = local(text)
    if found is None:
        raise UserError(
            f"{flag} {text}: neither a tfcli run nor a Hugging Face model directory (config.json) or GGUF file"
        )
    return found


def recorded(path: str | None) -> ModelSource | None:
    """The --from a run recorded (run.json), if it is still there."""
    return local(path) if path else None


def _is_run(path: Path) -> bool:
    """A tfcli run directory or one of its checkpoints: config.yaml beside checkpoints or weights."""
    return (checkpoint.run_dir_of(path) / "config.yaml").is_file() and (
        (path / checkpoint.CHECKPOINTS).is_dir() or checkpoint.has_weights(path)
    )


def _looks_like_run(path: Path) -> bool:
    """A tfcli run or checkpoint, whole or not (it has checkpoints/, or is a checkpoint)."""
    return (path / checkpoint.CHECKPOINTS).is_dir() or (
        checkpoint.has_weights(path) and (path / checkpoint.META).is_file()
    )


def _looks_like_hub_id(name: str) -> bool:
    """'gpt2' or 'google-t5/t5-small' (one optional owner), and no climbing out ('..')."""
    return bool(_HUB_ID.match(name)) and ".." not in name
