"""`ClassificationTask` is what text and image classification share: a head on the backbone (a
classifier on pooled features, or label words scored by a generative model), evaluation on every
split during training (the best checkpoint kept), and the same report for every route: accuracy
beside the majority class, per-class precision and recall, and the confusion matrix. A subclass
says only how its data is read (`load`) and which head reads it (`head`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor, nn

from ..data.sampler import Source, sequential_batches
from ..display import console, counted, phase
from ..engine.backbone import from_run
from ..engine.runtime import autocast_context, to_device
from ..engine.trainer import ObjectiveModule
from ..errors import UserError
from ..plugin import Batch, EvalOptions, Job, Plugin
from ..recipe import require
from .classification_report import metrics, tables


def blocks_read(head: HeadSettings) -> int:
    """The blocks a classifier's features need (its layer, the last-four poolings): what the memory
    plan's probes keep."""
    return max(1, head.layer, 4 if head.pooling.startswith("last4") else 1)


@dataclass(frozen=True)
class HeadSettings:
    """How a classification task's head reads the model and trains (the classify and image-classify
    sections extend it); the generative tasks have no head, so their sections do not."""

    head: Literal["auto", "classifier", "text"] = field(
        default="auto",
        metadata={
            "help": "classifier: on pooled features, or text: the label word as text (T5, GPT); auto: a classifier on encoders, the label word as text on T5 and GPT"
        },
    )
    pooling: Literal["auto", "cls", "mean", "last", "last4-sum", "last4-concat", "encoder-mean", "decoder-first"] = (
        field(
            default="auto",
            metadata={"help": "the features a classifier reads; auto: cls (BERT, ViT), last (GPT), encoder-mean (T5)"},
        )
    )
    head_lr: float = field(default=0.0, metadata={"help": "learning rate of the head (0: optim.lr)"})
    layer: int = field(
        default=-1,
        metadata={"help": "the depth a classifier reads: -1 the last block; n the n-th block (0: the embeddings)"},
    )

    def __post_init__(self):
        require(self.layer >= -1, "layer", ">= -1 (-1: the last block)", self.layer)
        require(self.head_lr >= 0, "head_lr", ">= 0", self.head_lr)


@dataclass
class TaskData:
    """A task's training data and evaluation splits (rows or images, whatever its head reads)."""

    train: Any
    evals: dict[str, Any]  # split -> data; the first split picks the best checkpoint
    labels: tuple[str, ...]


class Head:
    """How a classification task reads the backbone: its trainable heads, sources, loss and scores."""

    heads: nn.ModuleDict
    item_name = "ex"
    files: dict[str, str] = {}  # what the run directory keeps besides (an ImageGPT classifier's palette)

    def source(self, data, train: bool) -> Source:
        """Training batches (train=True) or scoring batches (train=False); both carry batch["labels"]."""
        raise NotImplementedError

    def loss(self, model: nn.Module, heads: nn.ModuleDict, batch: Batch):
        raise NotImplementedError

    def scores(self, model: nn.Module, heads: nn.ModuleDict, batch: Batch) -> Tensor:
        """(B, n_labels): higher is more likely."""
        raise NotImplementedError

    def flops_per_item(self, model: nn.Module, data, train: str) -> float:
        """Training FLOPs per item when finetune.train is `train` (perf.training_flops_multiplier)."""
        raise NotImplementedError

    def count_items(self, batch: Batch) -> int:
        return int(batch["labels"].numel())

    def unread(self, model: nn.Module) -> tuple:
        """The model's parameters this head never reaches (Job.unread): a text encoder's pooler, which
        only a classifier on its [CLS] reads."""
        return tuple(getattr(model, "pool_parameters", tuple)())  # a text encoder has one

    def notes(self) -> dict[str, float]:
        """Facts about the last scoring this head did, for its report (e.g. k-shot prompts that fit)."""
        return {}


@torch.no_grad()
def predict(
    module: ObjectiveModule,
    head: Head,
    source: Source,
    batch_size: int,
    device: torch.device,
    precision: str = "fp32",
    advance=lambda n=1: None,
) -> tuple[np.ndarray, np.ndarray]:
    """Scores (N, n_labels) and gold labels (N,) of every example of `source`, in order."""
    was = module.training
    module.eval()
    scores, gold = [], []
    for batch in counted(sequential_batches(source, batch_size, seed=0), advance):
        with autocast_context(precision, device):
            scores.append(module(to_device(batch, device), fn=head.scores).float().cpu())
        gold.append(batch["labels"])
    module.train(was)
    return torch.cat(scores).numpy(), torch.cat(gold).numpy()


class ClassificationTask(Plugin):
    kind = "task"

    def load(
        self, recipe, backbone, data: str | None = None, labels: tuple[str, ...] = (), need_train: bool = True
    ) -> TaskData:
        """The task's data (`data` instead of the recipe's, for `tfcli eval --data`); `labels`: the
        label set a trained classifier was trained with (evaluation must use its ids); need_train=False:
        evaluation, which may read data without a training split."""
        raise NotImplementedError

    def head(self, recipe, backbone, data: TaskData, options: EvalOptions | None = None) -> Head:
        raise NotImplementedError

    def sample(self, data, n: int, seed: int):
        """A seeded, class-balanced sample of n examples of one split (n <= 0: all)."""
        raise NotImplementedError

    def check(self, recipe, backbone, options: EvalOptions | None = None) -> None:
        """Refuse a request the backbone cannot serve (a head its family lacks) before any data is read."""

    def setup(self, recipe, backbone) -> Job:
        self.check(recipe, backbone)
        data = self.load(recipe, backbone)
        head = self.head(recipe, backbone, data)
        ft, t = recipe.finetune, recipe.train
        limited = {s: self.sample(d, ft.eval_limit, t.seed) for s, d in data.evals.items()}
        scoring = {s: head.source(d, train=False) for s, d in limited.items()}
        first = next(iter(limited))

        def evaluate(module: ObjectiveModule, run_dir: Path) -> dict[str, float]:
            out = {}
            for split, source in scoring.items():
                scores, gold = predict(module, head, source, t.batch_size, self.rt.device, t.precision)
                out[f"{split}_acc"] = float((scores.argmax(1) == gold).mean())
            return out

        return Job(
            heads=head.heads,
            loss=head.loss,
            train=head.source(data.train, train=True),
            val=head.source(limited[first], train=True),
            evaluate=evaluate,
            best_key=f"{first}_acc",
            flops_per_item=head.flops_per_item(backbone.model, data.train, ft.train),
            count_items=head.count_items,
            item_name=head.item_name,
            examples=len(data.train),
            labels=data.labels,
            files=head.files,
            unread=head.unread(backbone.model),
            head_lr=recipe.settings.head_lr,
            blocks_read=blocks_read(recipe.settings),
        )

    def score(self, recipe, backbone, options: EvalOptions) -> dict[str, dict]:
        """Metrics of every evaluation split (a sample of options.limit examples each)."""
        self.check(recipe, backbone, options)
        data = self.load(recipe, backbone, options.data, backbone.labels, need_train=options.few_shot > 0)
        head = self.head(recipe, backbone, data, options)
        head.heads.load_state_dict({k: v for k, v in backbone.heads.items() if k.split(".")[0] in head.heads})
        module = ObjectiveModule(backbone.model, head.heads, head.loss).to(self.rt.device)
        results = {}
        for split, d in data.evals.items():
            rows = self.sample(d, options.limit, options.seed)
            with phase(f"scoring {split}", math.ceil(len(rows) / recipe.train.batch_size), "batches") as advance:
                scores, gold = predict(
                    module,
                    head,
                    head.source(rows, train=False),
                    recipe.train.batch_size,
                    self.rt.device,
                    recipe.train.precision,
                    advance,
                )
            results[split] = {**metrics(scores.argmax(1), gold, data.labels), **head.notes()}
        return results

    def report(self, recipe, run_dir: Path) -> dict[str, Any]:
        """The best checkpoint on every evaluation split (all of it, or finetune.report_limit examples
        of each, else eval_limit's): printed, and saved as eval.json."""
        backbone = from_run(run_dir)
        limit = recipe.finetune.report_size
        results = self.score(recipe, backbone, EvalOptions(limit=limit))  # the sample `tfcli eval --limit N` scores
        self.show(results)
        (Path(run_dir) / "eval.json").write_text(
            json.dumps({"checkpoint": str(backbone.checkpoint), "limit": limit, **results}, indent=1)
        )
        return results

    def evaluate(self, recipe, backbone, options: EvalOptions) -> dict[str, Any]:
        """`tfcli eval`: one input's label probabilities, or the report on the evaluation splits,
        saved beside the run as eval-<what>.json (or --out), never over the training's eval.json."""
        if options.inputs:
            return self.classify_one(recipe, backbone, options)
        results = self.score(recipe, backbone, options)
        self.show(results)
        name = f"eval-{self.eval_name(recipe, options)}.json"
        if backbone.recipe is None:  # a Hugging Face model: the report goes to the working directory
            out = options.report_path(Path(f"eval-{Path(backbone.source).name}-{name[len('eval-') :]}"))
        else:
            out = options.report_path(Path(backbone.checkpoint).parent.parent / name)
        out.write_text(
            json.dumps(
                {"checkpoint": str(backbone.checkpoint), "data": options.data, "limit": options.limit, **results},
                indent=1,
            )
        )
        console.print(f"report: {out}")
        return results

    def classify_one(self, recipe, backbone, options: EvalOptions) -> dict[str, float]:
        raise UserError(f"{self.key} cannot classify a single input from the command line")

    def name(self, recipe) -> str:
        """What the reports call this task (a preset's name where there is one)."""
        return self.key

    def eval_name(self, recipe, options: EvalOptions) -> str:
        parts = (
            [self.name(recipe)]
            + ([Path(options.data).stem] if options.data else [])
            + ([f"limit{options.limit}"] if options.limit else [])
            + ([f"{options.few_shot}shot"] if options.few_shot >= 0 else [])
            + (["cloze"] if options.cloze else [])
        )
        return "-".join(parts)

    def show(self, results: dict[str, dict]) -> None:
        if self.quiet:
            return
        for split, result in results.items():
            for table in tables(split, result, result["labels"]):
                console.print(table)


def with_data(recipe, source: str | None):
    """The recipe reading its task data from `source` (eval --data) when given."""
    return recipe if not source else replace(recipe, data=replace(recipe.data, source=source, val_source=""))
