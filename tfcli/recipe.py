"""Recipes: YAML files that pin every hyperparameter, parsed into frozen, typed dataclasses.

`load(name_or_path, overrides)` reads a recipe, applies `a.b=value` overrides and checks every
key and type, naming the dotted path of anything wrong. A recipe names one plug-in: `objective:`
(pretraining) or `task:` (finetuning), validated against tfcli.registry. The plug-in's own settings
are a section named like its key (`mlm:`, `classify:`), typed by the plug-in's Config; only recipes
using that plug-in carry it. Task recipes also carry `finetune:` (what is trained, for how long).
The `model` section is the config dataclass of the family named by `model.family`.

`extends: other-recipe` starts from another recipe and overrides what this file sets.
Recipes are immutable: the driver derives a run's final recipe with `dataclasses.replace`.
"""

from __future__ import annotations

import dataclasses
import glob
import importlib.resources
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from . import registry
from .adapters import METHODS as RECORDS
from .errors import UserError
from .models import FAMILIES


def _recipes_dir() -> Path:
    """recipes/ of the checkout, installed as the package tfcli.recipes; a checkout run in place on
    PYTHONPATH, never installed (a machine with no network to build it), reads it beside tfcli/."""
    try:
        return Path(str(importlib.resources.files("tfcli.recipes")))
    except ModuleNotFoundError:
        return Path(__file__).resolve().parents[1] / "recipes"


RECIPES_DIR = _recipes_dir()
# field metadata: a path (or comma-separated paths) that a run records absolute, so that it names the
# same file from any directory; CODE: a list whose file.py:function parts are (a GRPO reward)
PATH = {"path": "path"}
CODE = {"path": "code"}


def require(ok: bool, field: str, expected: str, value: Any) -> None:
    """Raise the one-line error naming a field whose value is out of range (recipes call this from
    their dataclasses' __post_init__, so a bad value never reaches a run)."""
    if not ok:
        raise ValueError(f"{field} must be {expected}, got {value!r}")


_POWERS = {"": 0, "b": 0, "k": 1, "m": 2, "g": 3, "t": 4}


def parse_limit(text) -> float | None:
    """'auto' -> None; '0' -> 0 (no limit); '4GB', '4G', '3.5GiB', '4000MB' -> bytes (K, M, G and T
    with or without B or iB are powers of 1024, as memory is sold)."""
    text = str(text).strip().lower()
    if text == "auto":
        return None
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b)?", text)
    if not m or (m.group(3) == "ib" and not m.group(2)):
        raise ValueError(f"train.memory_limit must be auto, 0 or a size such as 4GB or 4000MB, got {text!r}")
    return float(m.group(1)) * 1024 ** _POWERS[m.group(2)]


@dataclass(frozen=True)
class TokenizerConfig:
    """bpe/wordpiece/unigram: trained on the training text; char: one id per character;
    file: load `path` (tokenizer.json, or a directory with vocab.json+merges.txt or vocab.txt)."""

    kind: Literal["bpe", "char", "wordpiece", "unigram", "file"] = field(
        default="bpe",
        metadata={
            "help": "bpe, wordpiece, unigram: a vocabulary learned from the training text; char: one id per character; file: tokenizer.path"
        },
    )
    vocab_size: int = field(default=8192, metadata={"help": "the learned vocabulary's size (0: the tokenizer's own)"})
    path: str = field(
        default="",
        metadata={
            "help": "tokenizer.kind file: a tokenizer.json, or a directory with vocab.json and merges.txt or vocab.txt",
            "path": "path",
        },
    )
    lowercase: bool = field(default=False, metadata={"help": "lowercase the text before tokenizing (uncased BERT)"})
    train_chars: int = field(
        default=5_000_000, metadata={"help": "characters of training text used to learn the vocabulary"}
    )

    def __post_init__(self):
        require(self.vocab_size >= 0, "tokenizer.vocab_size", ">= 0", self.vocab_size)
        require(self.train_chars >= 0, "tokenizer.train_chars", ">= 0", self.train_chars)
        require(self.kind != "file" or bool(self.path), "tokenizer.path", "set when tokenizer.kind is file", self.path)


@dataclass(frozen=True)
class DataConfig:
    """source: 'builtin', a file/glob/directory (comma-separated for several), or 'hf:name[:config]'."""

    source: str = field(
        default="builtin",
        metadata={
            "help": "builtin, builtin:NAME, files/globs/dirs (comma-separated), a token store, or hf:name[:config]",
            "path": "path",
        },
    )
    text_field: str = field(
        default="text", metadata={"help": "the column holding the text in JSON Lines, CSV and parquet files"}
    )
    val_fraction: float = field(
        default=0.1, metadata={"help": "the last fraction of the token stream (or a seeded share of rows) is held out"}
    )
    val_source: str = field(
        default="", metadata={"help": "optional separate held-out data instead of val_fraction", "path": "path"}
    )
    seq_len: int = field(default=256, metadata={"help": "tokens per example (finetuning: the longest input)"})
    sampling: Literal["blocks", "windows"] = field(
        default="blocks", metadata={"help": "shuffled non-overlapping blocks | random windows"}
    )
    document_mask: bool = field(
        default=False, metadata={"help": "packed blocks: attend within a document only, positions restart per document"}
    )
    workers: int = field(
        default=0, metadata={"help": "tokenizing processes (0: one per core, at most 8; one below 6M characters)"}
    )
    streaming: bool = field(
        default=False, metadata={"help": "read the documents as a stream (no store), shuffled through a buffer"}
    )
    shuffle_buffer: int = field(default=10_000, metadata={"help": "examples in the streaming shuffle buffer"})

    def __post_init__(self):
        require(0 <= self.val_fraction < 1, "data.val_fraction", "in [0, 1)", self.val_fraction)
        require(self.seq_len >= 2, "data.seq_len", ">= 2", self.seq_len)
        require(self.workers >= 0, "data.workers", ">= 0 (0: one per core)", self.workers)
        require(self.shuffle_buffer >= 1, "data.shuffle_buffer", ">= 1", self.shuffle_buffer)


@dataclass(frozen=True)
class OptimConfig:
    name: Literal["adamw", "adamw8bit", "adamw4bit"] = field(
        default="adamw",
        metadata={
            "help": "adamw (fused, fp32 moments) | adamw8bit | adamw4bit (torchao: the moments in 8 or 4 bits, a quarter or an eighth of the memory; tensors under 4,096 elements stay fp32)"
        },
    )
    lr: float = field(default=3e-4, metadata={"help": "the peak learning rate"})
    betas: tuple[float, float] = field(default=(0.9, 0.95), metadata={"help": "AdamW's two moment decay rates"})
    eps: float = field(default=1e-8, metadata={"help": "AdamW's epsilon"})
    weight_decay: float = field(
        default=0.1, metadata={"help": "applied to matrices only, never to biases, norms or 1-D parameters"}
    )

    def __post_init__(self):
        require(math.isfinite(self.lr) and self.lr > 0, "optim.lr", "a positive number", self.lr)
        require(all(0 <= b < 1 for b in self.betas), "optim.betas", "two numbers in [0, 1)", list(self.betas))
        require(self.eps > 0, "optim.eps", "> 0", self.eps)
        require(self.weight_decay >= 0, "optim.weight_decay", ">= 0", self.weight_decay)


@dataclass(frozen=True)
class ScheduleConfig:
    warmup_steps: int = field(default=100, metadata={"help": "optimizer steps of linear warmup to optim.lr"})
    decay: Literal["cosine", "linear", "constant"] = field(
        default="cosine", metadata={"help": "after warmup: cosine or linear down to schedule.min_lr, or constant"}
    )
    min_lr: float = field(default=0.0, metadata={"help": "the learning rate the decay ends at"})

    def __post_init__(self):
        require(self.warmup_steps >= 0, "schedule.warmup_steps", ">= 0", self.warmup_steps)
        require(self.min_lr >= 0, "schedule.min_lr", ">= 0", self.min_lr)


@dataclass(frozen=True)
class TrainConfig:
    steps: int = field(default=1000, metadata={"resumable": True, "help": "optimizer steps"})
    batch_size: int = field(
        default=16,
        metadata={
            "resumable": True,
            "help": "per-process batch size; the global batch is batch_size x grad_accum x processes",
        },
    )
    grad_accum: int = field(
        default=1, metadata={"resumable": True, "help": "micro-steps accumulated into one optimizer step"}
    )
    clip_grad: float = field(default=1.0, metadata={"help": "0 disables clipping"})
    precision: Literal["auto", "fp32", "bf16"] = field(
        default="auto", metadata={"resumable": True, "help": "auto: bf16 autocast on GPUs that have it, else fp32"}
    )
    seed: int = field(
        default=1337, metadata={"help": "the seed of every random choice: initialisation, data order, masks, sampling"}
    )
    log_interval: int = field(default=10, metadata={"resumable": True, "help": "optimizer steps between log lines"})
    eval_interval: int = field(
        default=250, metadata={"resumable": True, "help": "optimizer steps between held-out evaluations"}
    )
    eval_batches: int = field(
        default=20, metadata={"resumable": True, "help": "held-out batches each evaluation reads"}
    )
    ckpt_interval: int = field(default=500, metadata={"resumable": True, "help": "optimizer steps between checkpoints"})
    keep_checkpoints: int = field(
        default=2, metadata={"resumable": True, "help": "checkpoints kept (the best one besides)"}
    )
    device: str = field(default="auto", metadata={"resumable": True, "help": "auto | cpu | cuda | cuda:N"})
    threads: int = field(
        default=0,
        metadata={
            "resumable": True,
            "help": "torch CPU threads; 0: the cores this process may use, shared by the processes on this node",
        },
    )
    strategy: Literal["auto", "none", "ddp", "fsdp"] = field(
        default="auto", metadata={"resumable": True, "help": "auto: DDP under torchrun, else none; fsdp: FSDP2"}
    )
    activation_checkpointing: Literal["none", "blocks", "auto"] = field(
        default="auto",
        metadata={
            "resumable": True,
            "help": "recompute each block's activations in the backward pass: none | blocks | auto (the memory plan decides: on when the step's activations would outweigh the weights, frozen models and optimizer states and pass 1 GB, or when the run fits train.memory_limit only with it)",
        },
    )
    micro_batch_size: int = field(
        default=0,
        metadata={
            "resumable": True,
            "help": "rows per forward and backward, accumulated to batch_size (0: batch_size, or what memory_limit needs)",
        },
    )
    memory_limit: str = field(
        default="auto",
        metadata={
            "resumable": True,
            "help": "what one process may hold: auto (90% of the device's), 0 (no limit), or a size (4GB)",
        },
    )
    prefetch: int = field(
        default=2,
        metadata={
            "resumable": True,
            "help": "batches built ahead in a background thread (0: on the main thread, between steps)",
        },
    )
    compile: Literal["auto", "on", "off"] = field(
        default="auto", metadata={"resumable": True, "help": "torch.compile of model + loss; auto: on CUDA only"}
    )
    deterministic: bool = field(
        default=False,
        metadata={
            "resumable": True,
            "help": "repeatable kernels (torch.use_deterministic_algorithms): a GPU run the same to the bit every time, and resumed bit for bit (CUDA's repeatable kernels can be slower; the CPU's repeat anyway)",
        },
    )
    skip_nonfinite: int = field(
        default=0,
        metadata={"resumable": True, "help": "batches with a non-finite loss or gradient skipped before the run stops"},
    )
    loggers: tuple[str, ...] = field(
        default=(),
        metadata={
            "resumable": True,
            "help": "besides metrics.jsonl: csv, tensorboard, wandb (W&B offline unless WANDB_MODE)",
        },
    )
    max_time: float = field(
        default=0.0,
        metadata={
            "resumable": True,
            "help": "minutes of training (0: none); past it the run evaluates, checkpoints and stops",
        },
    )
    collective_timeout: float = field(
        default=10.0,
        metadata={
            "resumable": True,
            "help": "minutes a collective (torchrun) may wait before the run stops with an error",
        },
    )
    eval_tasks: tuple[str, ...] = field(
        default=(),
        metadata={
            "resumable": True,
            "help": "benchmarks scored at every evaluation of a decoder or encoder-decoder, name[:N] (N questions; a benchmark with subjects spreads them over its subjects), logged as val_<name>_acc and _acc_norm",
        },
    )
    eval_tasks_data: str = field(
        default="",
        metadata={
            "resumable": True,
            "help": "the directory of their files, or one holding each benchmark's directory",
            "path": "path",
        },
    )
    eval_tasks_few_shot: int = field(
        default=0,
        metadata={
            "resumable": True,
            "help": "solved examples before each question (from the benchmark's few-shot split)",
        },
    )
    select_by: str = field(
        default="",
        metadata={
            "help": "the logged metric that picks the best checkpoint, e.g. val_piqa_acc_norm (a loss or perplexity: the lowest; any other: the highest); \"\": the task's own (a classifier's accuracy, DPO's reward accuracy)"
        },
    )

    def __post_init__(self):
        require(self.steps >= 0, "train.steps", ">= 1 (0: a task's finetune.epochs decides)", self.steps)
        for name in (
            "batch_size",
            "grad_accum",
            "log_interval",
            "eval_interval",
            "eval_batches",
            "ckpt_interval",
            "keep_checkpoints",
        ):
            require(getattr(self, name) >= 1, f"train.{name}", ">= 1", getattr(self, name))
        require(self.clip_grad >= 0, "train.clip_grad", ">= 0 (0: no clipping)", self.clip_grad)
        require(self.threads >= 0, "train.threads", ">= 0", self.threads)
        require(self.skip_nonfinite >= 0, "train.skip_nonfinite", ">= 0", self.skip_nonfinite)
        require(self.max_time >= 0, "train.max_time", ">= 0 minutes (0: no limit)", self.max_time)
        require(self.collective_timeout > 0, "train.collective_timeout", "> 0 minutes", self.collective_timeout)
        for entry in self.eval_tasks:
            require(
                re.fullmatch(r"[\w./-]+(:\d+)?", str(entry)) is not None,
                "train.eval_tasks",
                "a list of benchmark[:questions], e.g. [piqa:500, mmlu:300]",
                list(self.eval_tasks),
            )
        require(self.eval_tasks_few_shot >= 0, "train.eval_tasks_few_shot", ">= 0", self.eval_tasks_few_shot)
        require(
            self.micro_batch_size == 0 or (self.micro_batch_size > 0 and self.batch_size % self.micro_batch_size == 0),
            "train.micro_batch_size",
            f"0 or a divisor of train.batch_size ({self.batch_size})",
            self.micro_batch_size,
        )
        parse_limit(self.memory_limit)  # a ValueError naming the field
        require(self.prefetch >= 0, "train.prefetch", ">= 0 (0: no prefetching)", self.prefetch)
        require(
            set(self.loggers) <= {"csv", "tensorboard", "wandb"},
            "train.loggers",
            "some of csv, tensorboard, wandb",
            list(self.loggers),
        )
        require(
            re.fullmatch(r"auto|cpu|cuda(:\d+)?|mps", self.device) is not None,
            "train.device",
            "auto, cpu, cuda, cuda:N or mps",
            self.device,
        )


@dataclass(frozen=True)
class FinetuneConfig:
    """What a task trains and for how long (task recipes only)."""

    train: Literal["all", "head", "lora", "qlora", "ia3", "bitfit", "projector"] = field(
        default="all",
        metadata={
            "help": "what trains: all | head (frozen backbone: a linear probe) | lora | qlora (LoRA on an NF4 base) | ia3 | bitfit | projector (a vision-language model's projector alone: LLaVA's first stage)"
        },
    )
    epochs: float = field(
        default=0.0,
        metadata={
            "resumable": True,
            "help": "epochs over the training examples (> 0: train.steps is derived from them)",
        },
    )
    warmup_fraction: float = field(
        default=0.0, metadata={"help": "> 0: schedule.warmup_steps becomes this share of the steps (BERT: 0.1)"}
    )
    limit: int = field(default=0, metadata={"help": "use only the first N training examples (0 = all)"})
    eval_limit: int = field(
        default=0,
        metadata={
            "resumable": True,
            "help": "evaluate during training on a balanced sample of N examples of each split (0 = all)",
        },
    )
    report_limit: int = field(
        default=0,
        metadata={
            "help": "the final report (eval.json) on a balanced sample of N examples of each split (0 = "
            "finetune.eval_limit's N when that is set, else all)"
        },
    )
    freeze_router: bool = field(
        default=False,
        metadata={
            "help": "a mixture of experts: its routers keep their pretrained weights (lora and qlora freeze them anyway)"
        },
    )
    train_vision: bool = field(
        default=False,
        metadata={
            "help": "a vision-language model: its vision tower trains too (all: every weight; lora, qlora, ia3: "
            "adapters on its linears too); off: frozen, as LLaVA keeps it"
        },
    )

    @property
    def report_size(self) -> int:
        """How many examples of each split the final report scores (0: all): report_limit, else the
        sample the run evaluated on (eval_limit): a short run that asked for a sample is not held up
        by scoring every held-out row at its end."""
        return self.report_limit or self.eval_limit

    def __post_init__(self):
        for name in ("epochs", "limit", "eval_limit", "report_limit"):
            require(getattr(self, name) >= 0, f"finetune.{name}", ">= 0", getattr(self, name))
        require(0 <= self.warmup_fraction < 1, "finetune.warmup_fraction", "in [0, 1)", self.warmup_fraction)


# the linears of the shared block an adapter may target (and of DeepSeek's latent attention: the query's
# bottleneck q_a, q_b, the latent's kv_a, kv_b)
PARTS = ("q", "k", "v", "o", "up", "gate", "down", "q_a", "q_b", "kv_a", "kv_b")
ALL_LINEAR = "all-linear"  # peft's name: every linear of the blocks (the generic path's too, named or not)


@dataclass(frozen=True)
class AdapterConfig:
    """Parameter-efficient finetuning (task recipes; used by finetune.train lora and ia3)."""

    rank: int = field(default=8, metadata={"help": "LoRA's rank r"})
    alpha: float = field(default=16.0, metadata={"help": "LoRA's alpha: the update is scaled by alpha / rank"})
    dropout: float = field(
        default=0.0, metadata={"help": "as PEFT; > 0 keeps a dropped-out copy of every adapted input for backward"}
    )
    targets: tuple[str, ...] = field(
        default=("q", "v"),
        metadata={
            "help": "lora's: block parts, or all-linear (every linear of the blocks, as peft's all-linear; on "
            "the generic path, linears tfcli has no part name for too); ia3 scales k, v and the MLP's inner "
            "activations"
        },
    )
    experts: bool = field(
        default=False,
        metadata={
            "help": "a mixture of experts: LoRA on every expert's targeted gate / up / down too, one adapter "
            "per expert (off: attention and any dense MLP only, as the experts hold most of the weights "
            "and each sees only its routed share of the tokens)"
        },
    )

    def __post_init__(self):
        require(self.rank >= 1, "adapter.rank", ">= 1", self.rank)
        require(self.alpha > 0, "adapter.alpha", "> 0", self.alpha)
        require(0 <= self.dropout < 1, "adapter.dropout", "in [0, 1)", self.dropout)
        require(
            bool(self.targets) and (set(self.targets) <= set(PARTS) or tuple(self.targets) == (ALL_LINEAR,)),
            "adapter.targets",
            f"some of {', '.join(PARTS)}, or {ALL_LINEAR} alone",
            list(self.targets),
        )

    @property
    def parts(self) -> tuple[str, ...]:
        """The part names the targets cover: all-linear covers every part, and a linear the generic path
        has no part name for (models.generic.UNNAMED)."""
        return (*PARTS, "linear") if tuple(self.targets) == (ALL_LINEAR,) else tuple(self.targets)


@dataclass(frozen=True)
class Recipe:
    name: str = ""
    objective: str = ""  # pretraining: an objective key (registry.OBJECTIVES)
    task: str = ""  # finetuning: a task key (registry.TASKS)
    model: Any = None  # the family's config dataclass, chosen by model.family
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    finetune: FinetuneConfig | None = None  # task recipes only
    adapter: AdapterConfig | None = None  # task recipes only
    settings: Any = None  # the plug-in's own section, written under its key (e.g. `mlm:`)
    # task recipes: per finetuning method (finetune.train), the fields it changes (`lora: {optim.lr: 1.0e-3,
    # ...}`), applied when the recipe is read unless an override sets them; a run's config.yaml has them applied
    methods: dict = field(default_factory=dict)

    @property
    def kind(self) -> str:
        return "objective" if self.objective else "task"

    @property
    def plugin(self) -> str:
        return self.objective or self.task


class RecipeError(UserError):
    pass


COMMON = ("name", "objective", "task", "model", "tokenizer", "data", "optim", "schedule", "train")


def recipe_path(name_or_path: str) -> Path:
    """A recipe name from recipes/ (without .yaml) or a path to a YAML file."""
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") or p.exists():
        if not p.is_file():
            raise RecipeError(f"recipe file not found: {name_or_path}")
        return p
    p = RECIPES_DIR / f"{name_or_path}.yaml"
    if not p.is_file():
        raise RecipeError(f"unknown recipe {name_or_path!r} (known: {', '.join(available()) or 'none'})")
    return p


def available() -> list[str]:
    return sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


def shipped_recipes(pattern: str, families: tuple[str, ...]) -> dict[str, str]:
    """family -> the shipped recipe `pattern` names for it ("{family}-mini"), for those that exist; a
    pattern that names no family ("electra-mini") is the first family's."""
    names = {f: pattern.format(family=f) for f in families} if "{family}" in pattern else {}
    if pattern and not names and families:
        names = {families[0]: pattern}
    return {f: n for f, n in names.items() if (RECIPES_DIR / f"{n}.yaml").is_file()}


def load(name_or_path: str, overrides: dict[str, Any] | None = None) -> Recipe:
    """Read a recipe (following `extends:`), apply dotted-path overrides, validate everything."""
    return from_dict(load_raw(name_or_path), overrides)


def load_raw(name_or_path: str, _depth: int = 0) -> dict:
    """A recipe file as plain data, with its `extends:` chain merged in (the file's name kept)."""
    path = recipe_path(name_or_path)
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise RecipeError(f"{path}: not valid YAML ({e.__class__.__name__})") from None
    if not isinstance(raw, dict):
        raise RecipeError(f"{path}: a recipe must be a mapping of sections")
    own_name, base = raw.get("name"), raw.pop("extends", None)
    if base is not None:
        if _depth >= 8:
            raise RecipeError(f"{path}: `extends` goes more than 8 recipes deep (a cycle?)")
        base_dir = path.parent / f"{base}.yaml"
        raw = _merge(load_raw(str(base_dir) if base_dir.is_file() else str(base), _depth + 1), raw)
    raw["name"] = own_name or path.stem
    return _anchor_paths(raw, path.parent)


def path_fields(raw: dict) -> list[tuple[str, str, str]]:
    """(section, field, path or code) of every path field a recipe's sections have (PATH and CODE
    metadata): the common sections' and its plug-in section's."""
    sections = {"data": DataConfig, "tokenizer": TokenizerConfig, "train": TrainConfig}
    kind = "objective" if raw.get("objective") else "task"
    key = raw.get(kind)
    if isinstance(key, str) and key in registry.known(kind):
        config = registry.plugin_class(kind, key).Config
        if config is not None:
            sections[key] = config
    return [
        (name, f.name, f.metadata["path"])
        for name, cls in sections.items()
        for f in dataclasses.fields(cls)
        if f.metadata.get("path")
    ]


def _anchor_paths(raw: dict, base: Path) -> dict:
    """Relative paths in a recipe mean `base` when they exist there (a recipe file's own folder, so a
    run's config.yaml finds its tokenizer.json and a recipe kept beside its data finds it from anywhere;
    then the working directory, for what the command line set), else they stay as they are."""
    for section, key, what in path_fields(raw):
        value = (raw.get(section) or {}).get(key) if isinstance(raw.get(section), dict) else None
        if isinstance(value, str) and value:
            anchor = _anchor if what == "path" else _anchor_code
            raw[section][key] = ",".join(anchor(part, base) for part in value.split(","))
    return raw


_CODE = re.compile(r"\s*(.+?\.py)(:.+)")  # file.py:function[:weight] (a GRPO reward)


def _anchor_code(part: str, base: Path) -> str:
    """file.py:function[:weight] with the file anchored; any other part (a built-in reward, a piece of
    a regex) as it was."""
    code = _CODE.fullmatch(part)
    if code:
        return _anchor(code.group(1), base) + code.group(2)
    for prefix in ("lookup:", "rm:"):  # a GRPO tool's table, a reward model run (with a weight)
        if part.strip().startswith(prefix):
            rest = part.strip()[len(prefix) :]
            path, weight = (rest, "") if (base / rest).exists() or ":" not in rest else rest.rsplit(":", 1)
            return prefix + _anchor(path, base) + (f":{weight}" if weight else "")
    return part


def _anchor(part: str, base: Path) -> str:
    """One comma-separated part made absolute when it names something that exists under `base`; any
    other part (builtin, hf:NAME, a chat template's name) comes back as it was."""
    name = part.strip()
    if name in ("builtin", "") or ":" in name.split("/")[0] or Path(name).is_absolute():
        return part  # builtin, builtin:NAME, hf:NAME, absolute paths
    beside = base / Path(name).expanduser()
    if any(c in name for c in "*?["):
        return str(beside) if glob.glob(str(beside)) else part
    return str(beside.resolve()) if beside.exists() else part


def from_dict(raw: dict, overrides: dict[str, Any] | None = None) -> Recipe:
    """A recipe from plain data with dotted-path overrides; relative paths that exist from the working
    directory are made absolute (a run records where its files are, and is read from anywhere)."""
    raw = _head_fields_moved(_deepcopy(raw))
    task: str = raw["task"] if isinstance(raw.get("task"), str) else ""
    for key, value in (overrides or {}).items():
        _set_path(raw, _moved_path(key, task), value)
    for key, value in method_defaults(raw, {_moved_path(k, task) for k in overrides or {}}).items():
        _set_path(raw, key, value)
    return _build_recipe(_anchor_paths(raw, Path.cwd()))


METHODS = typing.get_args(typing.get_type_hints(FinetuneConfig)["train"])  # adapters.METHODS' names


HEAD_FIELDS = ("head", "pooling", "head_lr", "layer")  # finetune.* before 0.3; now the classification tasks'


def _moved_path(path: str, task: str) -> str:
    """finetune.pooling (a recipe, an override or a methods entry of before 0.3) -> <task>.pooling."""
    section, _, name = path.partition(".")
    return f"{task}.{name}" if task and section == "finetune" and name in HEAD_FIELDS else path


def _head_fields_moved(raw: dict) -> dict:
    """A task recipe's classifier settings, which finetune: held before 0.3, moved to the task's section
    (classify, image-classify); a generative task's are dropped when they are the defaults it ignored."""
    task, ft = raw.get("task"), raw.get("finetune")
    if not isinstance(task, str) or not isinstance(ft, dict):
        return raw
    moved = {k: ft.pop(k) for k in HEAD_FIELDS if k in ft}
    config = registry.plugin_class("task", task).Config if task in registry.TASKS else None
    fields = {f.name for f in dataclasses.fields(config)} if config else set()
    defaults = {"head": "auto", "pooling": "auto", "head_lr": 0.0, "layer": -1}
    for name, value in moved.items():
        if name in fields:
            raw.setdefault(task, {}).setdefault(name, value)
        elif value != defaults[name]:
            raise RecipeError(f"finetune.{name}: {task} has no classifier head (it is a setting of classify)")
    table = raw.get("methods", raw.get("strategies"))
    if isinstance(table, dict):
        for entry in table.values():
            if isinstance(entry, dict):
                for key in [k for k in entry if _moved_path(k, task) != k]:
                    entry[_moved_path(key, task)] = entry.pop(key)
    return raw


def method_defaults(raw: dict, overridden: set[str]) -> dict[str, Any]:
    """The fields the recipe's `methods` entry for its finetune.train sets, but for those an override
    names (peft and litgpt ship per-method defaults: a LoRA wants another learning rate than full
    finetuning). A recipe written before 0.3 calls the table `strategies`."""
    if "strategies" in raw:
        raw["methods"] = raw.pop("strategies")
    table = raw.get("methods") or {}
    if not isinstance(table, dict):
        raise RecipeError(f"methods: expected a mapping of {', '.join(METHODS)} to fields")
    for name, fields in table.items():
        if name not in METHODS:
            raise RecipeError(f"methods.{name}: unknown finetuning method (one of {', '.join(METHODS)})")
        if not isinstance(fields, dict):
            raise RecipeError(f"methods.{name}: expected a mapping of fields, e.g. {{optim.lr: 1.0e-3}}")
    train = (raw.get("finetune") or {}).get("train", "all")
    fallback = RECORDS[train].defaults_from if train in RECORDS else ""  # QLoRA: LoRA's, unless named
    fields = table.get(train) or (table.get(fallback) if fallback else None) or {}
    return {k: v for k, v in fields.items() if k not in overridden}


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


def to_dict(recipe: Recipe, methods: bool = True) -> dict:
    """Plain data for YAML, in reading order; the plug-in section under its key (and, unless
    methods=False, as for a run's config.yaml where they are applied, the methods table)."""
    out = {
        "name": recipe.name,
        recipe.kind: recipe.plugin,
        "model": _plain(recipe.model),
        "tokenizer": _plain(recipe.tokenizer),
        "data": _plain(recipe.data),
    }
    if recipe.settings is not None:
        out[recipe.plugin] = _plain(recipe.settings)
    if recipe.finetune is not None:
        out["finetune"] = _plain(recipe.finetune)
        out["adapter"] = _plain(recipe.adapter or AdapterConfig())
    out.update(optim=_plain(recipe.optim), schedule=_plain(recipe.schedule), train=_plain(recipe.train))
    if methods and recipe.methods:
        out["methods"] = recipe.methods
    return out


def resumable(recipe: Recipe) -> set[str]:
    """The fields a resumed run may change: how long it trains and how it runs, never what it has
    trained with (each says so itself: metadata {"resumable": True})."""
    sections = {"train": recipe.train, "finetune": recipe.finetune, recipe.plugin: recipe.settings}
    return {
        f"{name}.{f.name}"
        for name, section in sections.items()
        if dataclasses.is_dataclass(section)
        for f in dataclasses.fields(section)
        if f.metadata.get("resumable")
    }


def changes(before: Recipe, after: Recipe) -> list[tuple[str, Any, Any]]:
    """(dotted field, old value, new value) for every field that differs."""

    def flat(d: dict, prefix: str = "") -> dict:
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
        return out

    a, b = flat(to_dict(before, methods=False)), flat(to_dict(after, methods=False))
    return [(k, a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


def save(recipe: Recipe, path: Path) -> None:
    """A run's resolved recipe (its method's fields applied, the table left out), replaced whole: the
    other ranks of a resumed run read it while rank 0 writes it again."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(yaml.safe_dump(to_dict(recipe, methods=False), sort_keys=False))
    os.replace(tmp, path)


def load_resolved(path: Path) -> Recipe:
    """Read a config.yaml written by save() (a run's resolved recipe)."""
    try:
        raw = yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as e:
        raise RecipeError(f"{path}: not valid YAML ({e.__class__.__name__})") from None
    if not isinstance(raw, dict):
        raise RecipeError(f"{path}: not a tfcli recipe")
    return from_dict(raw)


def replace(obj, **changes):
    """dataclasses.replace that names the field when a derived value is out of range."""
    try:
        return dataclasses.replace(obj, **changes)
    except ValueError as e:
        raise RecipeError(str(e)) from None


# --- validation -------------------------------------------------------------------------------


def _build_recipe(raw: dict) -> Recipe:
    objective, task = raw.get("objective") or "", raw.get("task") or ""
    if bool(objective) == bool(task):
        raise RecipeError("a recipe names exactly one of `objective` (pretraining) or `task` (finetuning)")
    kind, key = ("objective", objective) if objective else ("task", task)
    if not isinstance(key, str):
        raise RecipeError(f"{kind}: expected a name, got {key!r}")
    try:
        cls = registry.plugin_class(kind, key)
    except UserError as e:
        raise RecipeError(f"{kind}: {e}") from None
    allowed = set(COMMON) | ({"finetune", "adapter", "methods"} if task else set()) | ({key} if cls.Config else set())
    for k in raw:
        if k not in allowed:
            raise RecipeError(f"{k}: unknown key (allowed: {', '.join(sorted(allowed))})")
    if "model" not in raw:
        raise RecipeError("model: missing section (it needs at least model.family)")
    kwargs = {
        f.name: _coerce(typing.get_type_hints(Recipe)[f.name], raw[f.name], f.name)
        for f in dataclasses.fields(Recipe)
        if f.name in raw and f.name not in ("model", "finetune", "adapter", "methods")
    }
    kwargs["methods"] = {k: dict(v or {}) for k, v in (raw.get("methods") or {}).items()}
    kwargs["model"] = _build_model(raw["model"], "model")
    if task:
        kwargs["finetune"] = _build(FinetuneConfig, raw.get("finetune", {}), "finetune")
        kwargs["adapter"] = _build(AdapterConfig, raw.get("adapter", {}), "adapter")
    if cls.Config:
        kwargs["settings"] = _build(cls.Config, raw.get(key) or {}, key)
    return Recipe(**kwargs)


def _build(cls, raw: Any, path: str):
    if not isinstance(raw, dict):
        raise RecipeError(f"{path}: expected a mapping, got {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in names:
            raise RecipeError(f"{_join(path, key)}: unknown key (allowed: {', '.join(sorted(names))})")
    kwargs = {
        f.name: _coerce(hints[f.name], raw[f.name], _join(path, f.name))
        for f in dataclasses.fields(cls)
        if f.name in raw
    }
    try:
        return cls(**kwargs)
    except ValueError as e:  # a section shared by several plug-ins names its fields without the section
        message = str(e)
        raise RecipeError(message if not path or message.startswith(f"{path}.") else f"{path}.{message}") from None


def _build_model(raw: Any, path: str):
    if not isinstance(raw, dict) or "family" not in raw:
        raise RecipeError(f"{path}.family: missing (one of {', '.join(sorted(FAMILIES))})")
    family = raw["family"]
    if family not in FAMILIES:
        raise RecipeError(f"{path}.family: unknown family {family!r} (one of {', '.join(sorted(FAMILIES))})")
    return _build(FAMILIES[family][0], raw, path)


# YAML 1.1 booleans taken back as the word a field offers (train.activation_checkpointing was a boolean)
YAML_BOOLEAN_WORDS = {True: ("on", "yes", "true", "blocks"), False: ("off", "no", "false", "none")}


def _coerce(tp, value: Any, path: str):
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, path)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        return _coerce(next(a for a in args if a is not type(None)), value, path)
    if origin is Literal:
        if isinstance(value, bool):  # YAML 1.1 reads on/off/yes/no as booleans: take the word back
            value = next((w for w in YAML_BOOLEAN_WORDS[value] if w in args), value)
        if value not in args:
            raise RecipeError(f"{path}: {value!r} is not one of {', '.join(map(repr, args))}")
        return value
    if origin is tuple:
        if args[-1] is Ellipsis:  # tuple[str, ...]: any length
            if isinstance(value, str):
                value = [v.strip() for v in value.split(",") if v.strip()]
            if not isinstance(value, (list, tuple)):
                raise RecipeError(f"{path}: expected a list, got {value!r}")
            return tuple(_coerce(args[0], v, f"{path}[{i}]") for i, v in enumerate(value))
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise RecipeError(f"{path}: expected a list of {len(args)} values, got {value!r}")
        return tuple(_coerce(a, v, f"{path}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
    return _coerce_scalar(tp, value, path)


def _coerce_scalar(tp, value: Any, path: str):
    if tp is bool:
        if not isinstance(value, bool):
            raise RecipeError(f"{path}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise RecipeError(f"{path}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads 1e-3 as a string
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise RecipeError(f"{path}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if value is None:
            return ""
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise RecipeError(f"{path}: expected a string, got {value!r}")
        return str(value)
    if tp is Any:
        return value
    raise RecipeError(f"{path}: unsupported type {tp}")


def _plain(v):
    if dataclasses.is_dataclass(v):
        return {f.name: _plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
    if isinstance(v, (tuple, list)):
        return [_plain(x) for x in v]
    return v


def _merge(base: dict, over: dict) -> dict:
    """`over` on top of `base`, section by section; a model of another family replaces the base's."""
    out = dict(base)
    for k, v in over.items():
        other_family = isinstance(v, dict) and "family" in v and v["family"] != (out.get(k) or {}).get("family")
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) and not other_family else v
    return out


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


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else str(key)
