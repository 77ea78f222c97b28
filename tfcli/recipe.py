"""Recipes: YAML files that pin every hyperparameter, parsed into typed, validated dataclasses.

`load(name_or_path, overrides)` reads a recipe, applies `a.b=value` overrides, and checks every
key and type, naming the dotted path of anything wrong. The `model` section is the config
dataclass of the family named by `model.family` (see tfcli.models.FAMILIES).
"""
from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

import yaml

from .errors import UserError

RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"


@dataclass
class TokenizerConfig:
    """bpe/wordpiece/unigram: trained on the training text; char: one id per character;
    file: load `path` (tokenizer.json, or a directory with vocab.json+merges.txt or vocab.txt)."""

    kind: Literal["bpe", "char", "wordpiece", "unigram", "file"] = "bpe"
    vocab_size: int = 8192
    path: str = ""
    lowercase: bool = False
    train_chars: int = 5_000_000  # characters of training text used to learn the vocabulary


@dataclass
class DataConfig:
    """source: 'builtin', a file/glob/directory (comma-separated for several), or 'hf:name[:config]'."""

    source: str = "builtin"
    text_field: str = "text"
    val_fraction: float = 0.1  # the last fraction of the token stream is held out
    val_source: str = ""  # optional separate held-out data instead of val_fraction
    seq_len: int = 256
    sampling: Literal["blocks", "windows"] = "blocks"  # shuffled non-overlapping blocks | random windows


@dataclass
class OptimConfig:
    lr: float = 3e-4
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1  # applied to matrices only, never to biases, norms or embeddings' positions


@dataclass
class ScheduleConfig:
    warmup_steps: int = 100
    decay: Literal["cosine", "linear", "constant"] = "cosine"
    min_lr: float = 0.0


@dataclass
class TrainConfig:
    steps: int = 1000
    batch_size: int = 16  # per process; the global batch is batch_size * grad_accum * processes
    grad_accum: int = 1
    clip_grad: float = 1.0  # 0 disables clipping
    precision: Literal["fp32", "bf16"] = "fp32"
    seed: int = 1337
    log_interval: int = 10
    eval_interval: int = 250
    eval_batches: int = 20
    ckpt_interval: int = 500
    keep_checkpoints: int = 2
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    threads: int = 0  # torch CPU threads; 0 keeps torch's default


@dataclass
class MLMConfig:
    """BERT's masked-LM objective (objective: mlm): masking and how segments are built."""

    nsp: bool = True  # false: RoBERTa-style full segments, no next-sentence prediction
    mask_prob: float = 0.15  # share of non-special tokens chosen; of those 80% [MASK], 10% random, 10% kept
    short_seq_prob: float = 0.1  # pairs made shorter than data.seq_len on purpose, as in BERT
    documents: Literal["rows", "paragraphs"] = "rows"  # a document is a data row, or each blank-line paragraph


@dataclass
class TaskConfig:
    """Finetuning: which task, its data, how features are pooled and what is trained."""

    name: str = ""  # mnli | image-classify | ... ('' for pretraining recipes)
    data: str = ""  # the task's data (directory or files); '' = the task's default source
    pooling: Literal["cls", "mean", "last4-sum", "last4-concat"] = "cls"
    train: Literal["all", "head"] = "all"  # head: frozen backbone (linear probe)
    head_lr: float = 0.0  # 0 = optim.lr
    max_length: int = 128
    epochs: float = 0.0  # > 0: train.steps is derived from the epochs and the training rows
    limit: int = 0  # use only the first N training rows (0 = all)
    eval_limit: int = 0  # evaluate on the first N rows of each split (0 = all)
    warmup_fraction: float = 0.0  # > 0: schedule.warmup_steps becomes this share of the steps (BERT: 0.1)


@dataclass
class ImagesConfig:
    """Image objectives and tasks (MAE, image-classify): training augmentation and normalisation.
    Pixels are scaled to [0, 1], then (x - mean) / std per channel; the size is model.image_size."""

    augment: bool = True  # random resized crop + horizontal flip on training images
    crop_scale: tuple[float, float] = (0.2, 1.0)  # area fraction of the random crop (MAE: 0.2-1)
    crop_ratio: tuple[float, float] = (0.75, 1.3333333)  # aspect ratio range of the crop
    hflip: bool = True
    mean: tuple[float, float, float] = (0.485, 0.456, 0.406)
    std: tuple[float, float, float] = (0.229, 0.224, 0.225)


@dataclass
class Recipe:
    name: str = ""
    objective: str = "clm"
    model: Any = None  # the family's config dataclass, chosen by model.family
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    images: ImagesConfig = field(default_factory=ImagesConfig)
    mlm: MLMConfig = field(default_factory=MLMConfig)


class RecipeError(UserError):
    pass


def recipe_path(name_or_path: str) -> Path:
    """A recipe name from recipes/ (without .yaml) or a path to a YAML file."""
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") or p.exists():
        if not p.is_file():
            raise RecipeError(f"recipe file not found: {name_or_path}")
        return p
    p = RECIPES_DIR / f"{name_or_path}.yaml"
    if not p.is_file():
        known = ", ".join(available()) or "none"
        raise RecipeError(f"unknown recipe {name_or_path!r} (known: {known})")
    return p


def available() -> list[str]:
    return sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


def load(name_or_path: str, overrides: Optional[dict[str, Any]] = None) -> Recipe:
    """Read a recipe, apply dotted-path overrides, validate everything."""
    path = recipe_path(name_or_path)
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise RecipeError(f"{path}: not valid YAML ({e.__class__.__name__})") from None
    if not isinstance(raw, dict):
        raise RecipeError(f"{path}: a recipe must be a mapping of sections")
    raw.setdefault("name", path.stem)
    return from_dict(raw, overrides)


def from_dict(raw: dict, overrides: Optional[dict[str, Any]] = None) -> Recipe:
    raw = _deepcopy(raw)
    for key, value in (overrides or {}).items():
        _set_path(raw, key, value)
    return _build(Recipe, raw, "")


def parse_override(text: str) -> tuple[str, Any]:
    """'optim.lr=3e-4' -> ('optim.lr', 0.0003). The value is read as YAML."""
    if "=" not in text:
        raise RecipeError(f"override {text!r} must look like key.path=value")
    key, value = text.split("=", 1)
    key = key.strip()
    if not key:
        raise RecipeError(f"override {text!r} has an empty key")
    try:
        return key, yaml.safe_load(value) if value.strip() else ""
    except yaml.YAMLError:
        return key, value


def to_dict(recipe: Recipe) -> dict:
    """Plain data for YAML (tuples become lists)."""
    def plain(v):
        if dataclasses.is_dataclass(v):
            return {f.name: plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
        if isinstance(v, (tuple, list)):
            return [plain(x) for x in v]
        return v
    return plain(recipe)


def save(recipe: Recipe, path: Path) -> None:
    path.write_text(yaml.safe_dump(to_dict(recipe), sort_keys=False))


def load_resolved(path: Path) -> Recipe:
    """Read a config.yaml written by save() (a run's resolved recipe)."""
    return from_dict(yaml.safe_load(Path(path).read_text()))


# --- validation -------------------------------------------------------------------------------

def _deepcopy(d):
    if isinstance(d, dict):
        return {k: _deepcopy(v) for k, v in d.items()}
    if isinstance(d, list):
        return [_deepcopy(v) for v in d]
    return d


def _set_path(raw: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = raw
    for i, part in enumerate(parts[:-1]):
        nxt = node.setdefault(part, {})
        if not isinstance(nxt, dict):
            raise RecipeError(f"{'.'.join(parts[: i + 1])}: is a value, not a section")
        node = nxt
    node[parts[-1]] = value


def _build(cls, raw: Any, path: str):
    where = path or "recipe"
    if not isinstance(raw, dict):
        raise RecipeError(f"{where}: expected a mapping, got {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in names:
            raise RecipeError(f"{_join(path, key)}: unknown key (allowed: {', '.join(sorted(names))})")
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in raw:
            continue
        sub = _join(path, f.name)
        if cls is Recipe and f.name == "model":
            kwargs["model"] = _build_model(raw["model"], sub)
        else:
            kwargs[f.name] = _coerce(hints[f.name], raw[f.name], sub)
    if cls is Recipe and "model" not in kwargs:
        raise RecipeError("model: missing section (it needs at least model.family)")
    try:
        return cls(**kwargs)
    except ValueError as e:
        raise RecipeError(str(e)) from None


def _build_model(raw: Any, path: str):
    from .models import FAMILIES

    if not isinstance(raw, dict) or "family" not in raw:
        raise RecipeError(f"{path}.family: missing (one of {', '.join(sorted(FAMILIES))})")
    family = raw["family"]
    if family not in FAMILIES:
        raise RecipeError(f"{path}.family: unknown family {family!r} (one of {', '.join(sorted(FAMILIES))})")
    return _build(FAMILIES[family][0], raw, path)


def _coerce(tp, value: Any, path: str):
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, path)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(inner[0], value, path)
    if origin is Literal:
        if value not in args:
            raise RecipeError(f"{path}: {value!r} is not one of {', '.join(map(repr, args))}")
        return value
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise RecipeError(f"{path}: expected a list of {len(args)} values, got {value!r}")
        return tuple(_coerce(a, v, f"{path}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
    if origin is list:
        if not isinstance(value, list):
            raise RecipeError(f"{path}: expected a list, got {value!r}")
        return [_coerce(args[0], v, f"{path}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if not isinstance(value, bool):
            raise RecipeError(f"{path}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise RecipeError(f"{path}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool):
            raise RecipeError(f"{path}: expected a number, got {value!r}")
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads 1e-3 as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise RecipeError(f"{path}: expected a number, got {value!r}")
    if tp is str:
        if value is None:
            return ""
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise RecipeError(f"{path}: expected a string, got {value!r}")
        return str(value)
    if tp is Any:
        return value
    raise RecipeError(f"{path}: unsupported type {tp}")


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else str(key)
