"""Hugging Face directories <-> tfcli weights: one engine; each family supplies only tables.

A table module (gpt2.py, bert.py, t5.py, vit.py, ...) supplies what record.Table declares, for the
architectures whose records (hf/registry.py) name it:
  config_from_hf(raw, state)     config.json (+ weights, for what only they tell) -> tfcli model config
  rules(cfg)                     the weight table: one Rule per tfcli tensor
  export(backbone, recipe)       -> Export: config.json, architecture, extra tensors and files
  normalize(state)               (optional) older or prefix-less transformers names -> the table's
  load_state(path, raw, shapes)  (optional) reads the directory's weights itself (the generic path: as
                                 transformers reads them), instead of this module's read_state
and this module does the rest, the same way for every family: reading a directory (single or
sharded safetensors, or pytorch_model.bin read with weights_only=True), renaming, fusing and
splitting q/k/v (by their widths under grouped-query attention), transposing Conv1D weights, and writing a directory transformers loads.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor

from ..errors import UserError

CONFIG = "config.json"


@dataclass(frozen=True)
class Rule:
    """One tfcli tensor and the transformers tensor(s) it is made of."""

    ours: str  # name in a tfcli checkpoint: "model.blocks.0.attn.qkv.weight", "heads.mlm.bias"
    theirs: tuple[str, ...]  # several: concatenated along dim 0 (fused q/k/v) and split again on export
    transpose: bool = False  # the last two dimensions swapped: transformers' Conv1D stores (in, out)
    # (GPT-2), gpt-oss its experts (E, in, out)
    optional: bool = False  # present only in some checkpoints (pretraining heads, a pooler)
    widths: tuple[int, ...] = ()  # rows of each of `theirs` when unequal (grouped-query q / k / v)
    part: tuple[int, int] = (0, 1)  # (i, n): ours is the i-th of n equal row blocks of theirs (Phi-3's gate_up_proj)
    offset: float = 0.0  # ours = theirs + offset (Gemma stores its norms' weights as w, scaling by 1 + w)
    stack: bool = False  # ours stacks theirs along a new first dimension (a mixture's experts: (E, out, in))
    lead: int = 0  # ours has this many more leading dimensions of size 1 (CLIP's class embedding (D,) -> (1, 1, D))
    strided: tuple[int, int] = (0, 1)  # (i, n): ours is every n-th entry of theirs' last dimension from
    # the i-th on, before any transpose (gpt-oss's gate and up, interleaved in one gate_up_proj)


def rule(
    ours: str,
    *theirs: str,
    transpose: bool = False,
    optional: bool = False,
    widths: tuple[int, ...] = (),
    part: tuple[int, int] = (0, 1),
    offset: float = 0.0,
    stack: bool = False,
    lead: int = 0,
    strided: tuple[int, int] = (0, 1),
) -> Rule:
    return Rule(ours, tuple(theirs), transpose, optional, tuple(widths), tuple(part), offset, stack, lead, strided)  # type: ignore[arg-type]


@dataclass
class Export:
    """What a family writes for one run: config.json, its architecture, and anything beyond the table."""

    config: dict
    extra_tensors: dict[str, Tensor] = field(default_factory=dict)  # e.g. fixed sin-cos positions
    files: dict[str, Any] = field(default_factory=dict)  # file name -> text or bytes (tokenizer_config.json, ...)
    rules: list[Rule] | None = None  # another architecture's names than the family's table (e.g. Dinov2)
    loads_with: str = ""  # how to load it, printed by `tfcli export` ("" : the Auto class of its architecture)
    convert: Any = None  # the state under the table's names -> as the files hold it (the generic path's)


AUTO_CLASSES = {
    "ForSequenceClassification": "AutoModelForSequenceClassification",
    "ForImageClassification": "AutoModelForImageClassification",
    "LMHeadModel": "AutoModelForCausalLM",
    "ForCausalLM": "AutoModelForCausalLM",
    "ForConditionalGeneration": "AutoModelForSeq2SeqLM",
    "ForMaskedLM": "AutoModelForMaskedLM",
    "ForPreTraining": "AutoModelForPreTraining",
}


IMAGE_TEXT = ("LlavaForConditionalGeneration", "Idefics3ForConditionalGeneration", "SmolVLMForConditionalGeneration")


def auto_class(architecture: str) -> str:
    """The transformers Auto class that loads `architecture` whole (AutoModel for a bare encoder)."""
    if architecture in IMAGE_TEXT:
        return "AutoModelForImageTextToText"
    return next((auto for suffix, auto in AUTO_CLASSES.items() if architecture.endswith(suffix)), "AutoModel")


def refuse_classifier(family: str, pooling: str, exportable: str) -> None:
    """One line for a classifier whose pooling no transformers class computes: an export that loaded
    would carry a random head, so none is written."""
    raise UserError(
        f"this {family} run classifies from --pooling {pooling}, which no transformers class computes "
        f"(an export would load with a random classifier); {exportable}"
    )


def renamed(state: dict[str, Tensor], patterns: list[tuple[str, str]]) -> dict[str, Tensor]:
    """Every name with each (regex, replacement) applied in turn: another version's names -> the table's."""
    out = {}
    for k, v in state.items():
        for pattern, repl in patterns:
            k = re.sub(pattern, repl, k)
        out[k] = v
    return out


def to_tfcli(state: dict[str, Tensor], rules: list[Rule]) -> dict[str, Tensor]:
    """transformers state dict -> tfcli state dict (model.* and heads.*), per the table."""
    out = {}
    for r in rules:
        present = [t in state for t in r.theirs]
        if not all(present):
            if r.optional and not any(present):
                continue
            raise UserError(f"not a matching checkpoint: weight {r.theirs[present.index(False)]!r} is missing")
        join = torch.stack if r.stack else torch.cat
        t = join([state[n] for n in r.theirs], dim=0) if len(r.theirs) > 1 or r.stack else state[r.theirs[0]]
        if r.part[1] > 1:
            t = t.chunk(r.part[1], dim=0)[r.part[0]]
        if r.strided[1] > 1:
            t = t[..., r.strided[0] :: r.strided[1]]
        if r.offset:
            t = t + r.offset
        if r.lead:
            t = t.reshape((1,) * r.lead + tuple(t.shape))
        out[r.ours] = t.transpose(-2, -1).contiguous() if r.transpose else t.contiguous() if r.strided[1] > 1 else t
    return out


def to_hf(state: dict[str, Tensor], rules: list[Rule]) -> dict[str, Tensor]:
    """tfcli state dict -> transformers state dict: the inverse of to_tfcli (fused weights split, the
    parts of one of theirs joined)."""
    out, pieces, strides = {}, {}, {}
    for r in rules:
        if r.ours not in state:
            if r.optional:
                continue
            raise KeyError(r.ours)
        t = state[r.ours].transpose(-2, -1) if r.transpose else state[r.ours]
        if r.lead:
            t = t.reshape(t.shape[r.lead :])
        if r.offset:
            t = t - r.offset
        if r.part[1] > 1:
            pieces.setdefault(r.theirs[0], [None] * r.part[1])[r.part[0]] = t
            continue
        if r.strided[1] > 1:
            strides.setdefault(r.theirs[0], [None] * r.strided[1])[r.strided[0]] = t
            continue
        if r.stack:
            parts = t.unbind(0)
        else:
            parts = t.split(list(r.widths), dim=0) if r.widths else t.chunk(len(r.theirs), dim=0)
        for name, part in zip(r.theirs, parts):
            out[name] = part
    out.update({name: torch.cat(parts, dim=0) for name, parts in pieces.items()})
    return {**out, **{name: torch.stack(parts, dim=-1).flatten(-2) for name, parts in strides.items()}}


# --- directories --------------------------------------------------------------------------------


def read_config(path: Path, name: str = CONFIG) -> dict:
    """A directory's config.json (or another JSON file of it), or a one-line error saying what is wrong."""
    file = Path(path) / name
    if not file.is_file():
        raise UserError(f"{path}: no config.json; not a Hugging Face model directory")
    try:
        raw = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{file}: not valid JSON ({e.__class__.__name__})") from None
    if not isinstance(raw, dict):
        raise UserError(f"{file}: not a transformers config")
    return raw


def read_state(path: Path, shapes_only: bool = False) -> dict[str, Tensor]:
    """The weights of a transformers directory: model.safetensors, a sharded safetensors index, or
    pytorch_model.bin (single or sharded) loaded with weights_only=True (no code runs). shapes_only:
    meta tensors of their shapes and dtypes, nothing read but the files' headers (a memory plan)."""
    path = Path(path)
    safetensors, binary = (_safetensors_shapes, _bin_shapes) if shapes_only else (_load_safetensors, _load_bin)
    for index, loader in (
        ("model.safetensors.index.json", safetensors),
        ("pytorch_model.bin.index.json", binary),
    ):
        if (path / index).is_file():
            shards = sorted(set(json.loads((path / index).read_text())["weight_map"].values()))
            state = {}
            for shard in shards:
                state.update(loader(path / shard))
            return state
    if (path / "model.safetensors").is_file():
        return safetensors(path / "model.safetensors")
    if (path / "pytorch_model.bin").is_file():
        return binary(path / "pytorch_model.bin")
    raise UserError(f"{path}: no model.safetensors, sharded safetensors or pytorch_model.bin")


def _load_safetensors(file: Path) -> dict[str, Tensor]:
    try:
        return load_file(str(file))
    except (SafetensorError, OSError) as e:
        raise UserError(f"{file}: not a readable safetensors file ({str(e).splitlines()[0][:120]})") from None


def _safetensors_shapes(file: Path) -> dict[str, Tensor]:
    from safetensors import safe_open

    try:
        with safe_open(str(file), "pt") as f:
            return {k: _meta(f.get_slice(k)) for k in f.keys()}
    except (SafetensorError, OSError) as e:
        raise UserError(f"{file}: not a readable safetensors file ({str(e).splitlines()[0][:120]})") from None


def _meta(piece) -> Tensor:
    dtypes = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}
    return torch.empty(piece.get_shape(), dtype=dtypes.get(piece.get_dtype(), torch.float32), device="meta")


def _bin_shapes(file: Path) -> dict[str, Tensor]:
    return {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in _load_bin(file, mmap=True).items()}


def _load_bin(file: Path, mmap: bool = False) -> dict[str, Tensor]:
    try:
        return torch.load(file, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as e:  # weights_only refuses pickled code; a truncated file fails to unpickle
        raise UserError(
            f"{file}: refused or unreadable with weights_only=True "
            f"({str(e).splitlines()[0][:120]}); convert it to safetensors"
        ) from None


def check_writable(out: Path) -> None:
    """Refuse a --hf directory that exists with something in it: never write into another model."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"{out} exists and is not an empty directory; choose a new --hf directory")


def write_dir(
    out: Path,
    config: dict,
    state: dict[str, Tensor],
    files: dict[str, str],
    weights: str = "model.safetensors",
    config_name: str | None = CONFIG,
) -> None:
    """config.json, model.safetensors (or `weights`) and the given text files, readable by everyone (0644)."""
    check_writable(out)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().cpu().contiguous().clone() for k, v in state.items()}
    save_file(tensors, str(out / weights), metadata={"format": "pt"})
    if config_name:
        (out / config_name).write_text(json.dumps(config, indent=2))
    for name, content in files.items():  # names may hold a folder (sentence-transformers' 1_Pooling/config.json)
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_bytes(content) if isinstance(content, bytes) else (out / name).write_text(content)
    for f in out.rglob("*"):
        os.chmod(f, 0o755 if f.is_dir() else 0o644)


def json_text(obj: Any) -> str:
    return json.dumps(obj, indent=2)
