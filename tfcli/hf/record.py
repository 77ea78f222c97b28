"""One record per Hugging Face architecture tfcli reads natively: what it is, declared as data.

A record names a transformers `model_type`, the tfcli family it builds, the transformers class its
export writes, llama.cpp's architecture for it, whether its directory holds an image processor, and
the table module that maps its config and weights both ways (the `Table` interface below). The
records are declared together in hf/registry.py, and `tfcli models`, the README's and the docs' architecture tables and the tests' parity matrix are
generated from that one registry. (torchtitan's ModelSpec, litgpt's Config: a model is data.)
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from torch import Tensor


@runtime_checkable
class Table(Protocol):
    """The config map and weight table of one or more architectures (a module of hf/)."""

    def config_from_hf(self, raw: dict, state: Any) -> Any:
        """config.json (+ weights, for what only they tell) -> tfcli's model config."""

    def rules(self, cfg: Any) -> list:
        """The weight table: one convert.Rule per tfcli tensor, for import, export, PEFT and GGUF."""

    def export(self, backbone: Any, recipe: Any) -> Any:
        """A run -> convert.Export: config.json, architecture, extra tensors and files."""


@dataclass(frozen=True)
class Record:
    """One transformers model_type tfcli reads (and writes) natively."""

    model_type: str  # config.json's model_type
    name: str  # as people name it: "Qwen3-MoE"
    family: str  # the tfcli family it builds (models.FAMILIES)
    table_module: str  # its config map and weight table: a module of tfcli/hf/ (the Table interface)
    architecture: str = ""  # the transformers class an export writes ("": chosen by the run's head)
    gguf: str = ""  # llama.cpp's general.architecture for it ("": no GGUF in or out)
    reads_images: bool = False  # its directory's image processor settings go to config_from_hf
    traits: Any = None  # what its table reads of how it differs from its group (hf/traits.py)

    @property
    def table(self) -> Table:
        """Its table module, imported when first asked for (the registry is data: it imports no table,
        so that a table may ask the registry)."""
        module = importlib.import_module(f"{__package__}.{self.table_module}")
        if not isinstance(module, Table):
            raise TypeError(f"record {self.model_type!r}: {module.__name__} lacks config_from_hf, rules or export")
        return module

    def normalize(self, state: dict[str, Tensor]) -> dict[str, Tensor]:
        """Older or prefix-less transformers names -> the table's (a table's own `normalize`, if any)."""
        own = getattr(self.table, "normalize", None)
        return own(state) if own else state

    def read_state(self, path: Path, raw: dict, shapes_only: bool) -> dict[str, Tensor]:
        """The directory's weights: by the table's own reader where it has one (the generic path reads
        them as transformers does), else as convert.read_state reads every family's."""
        from .convert import read_state

        own = getattr(self.table, "load_state", None)
        return own(path, raw, shapes_only) if own else read_state(path, shapes_only)
