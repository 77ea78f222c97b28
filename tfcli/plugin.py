"""The one contract that objectives (pretraining) and tasks (finetuning) implement.

The driver (tfcli.driver) asks a plug-in, in order:
  special_tokens(family)     what a tokenizer trained or loaded for it must contain
  tokenizer_texts(recipe)    text to train a fresh tokenizer on (pretraining)
  setup(recipe, backbone)    -> Job: heads, training and held-out data, loss, evaluation, FLOPs
  report(recipe, run_dir)    after training: the final report (e.g. accuracy of the best checkpoint)
  hints(run_dir)             what to run next
and `tfcli eval` asks evaluate(recipe, backbone, options).

A plug-in is registered by key in tfcli.registry; its recipe section is its `Config` dataclass.
Losses and evaluations receive the model, the heads and a batch, never the trainer's wrapper.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar

from torch import Tensor, nn

from .data.sampler import Source
from .engine.runtime import Runtime
from .models import families_of, kinds, model_class
from .recipe import shipped_recipes

Batch = dict[str, Tensor]
LossFn = Callable[[nn.Module, nn.ModuleDict, Batch], tuple[Tensor, dict[str, Tensor]]]


@dataclass
class EvalOptions:
    """What `tfcli eval` was asked for, beyond the run."""

    data: str | None = None  # evaluate on this data instead of the run's
    limit: int = 0  # a sample of N examples of each split
    batches: int = 0  # held-out batches for pretraining runs (0: the recipe's train.eval_batches)
    out: Path | None = None  # where to write a picture or report
    inputs: tuple[str, ...] = ()  # classify one input (e.g. premise and hypothesis) instead of a split
    few_shot: int = -1  # >= 0: k-shot prompting of an un-finetuned decoder/encoder-decoder
    cloze: bool = False  # zero-shot: label words scored at a [MASK] by a BERT's MLM head
    reference: str | None = None  # preference evaluation: the model the rewards are measured against
    seed: int = 0
    device: str = "cpu"
    precision: str | None = None  # None: the run's own train.precision
    quiet: bool = False
    # the user's own code this command's command line names (file.py:function, absolute): the only code
    # an evaluation may import (a GRPO run's reward function); a run records such names as data
    named_code: frozenset[str] = frozenset()

    def report_path(self, default: Path) -> Path:
        """Where an evaluation writes its report: --out (its folder made), else `default`."""
        if self.out is None:
            return Path(default)
        Path(self.out).parent.mkdir(parents=True, exist_ok=True)
        return Path(self.out)


@dataclass
class Job:
    """Everything the trainer needs from a plug-in for one run."""

    heads: nn.ModuleDict  # what the plug-in adds to the backbone (trained with it, saved as heads.*)
    loss: LossFn  # (model, heads, batch) -> (loss, metrics of scalar tensors)
    train: Source  # training data; the driver's one Sampler draws from it
    val: Source | None  # held-out data for the periodic loss (first train.eval_batches batches)
    flops_per_item: float  # training FLOPs per token/example/image, for MFU
    count_items: Callable[[Batch], int]  # tokens (examples, images) a batch counts for
    item_name: str = "tok"
    held_out_metrics: Callable[[dict[str, float]], dict[str, float]] = lambda m: m  # e.g. add perplexity
    # run at each evaluation with the trained module (train.ObjectiveModule) and the run directory;
    # returns metrics to log (e.g. accuracy) and may write files (e.g. MAE's reconstruction pictures)
    evaluate: Callable[[nn.Module, Path], dict[str, float]] | None = None
    best_key: str = ""  # the metric that picks the best checkpoint (train.select_by may name another); "" = none
    best_lowest: bool = False  # the lowest best_key is the best (a loss), not the highest
    examples: int = 0  # training examples per epoch, for finetune.epochs
    labels: tuple[str, ...] = ()  # a classifier's class names (saved in the run as labels.json)
    # models the loss reads but never trains (a preference-tuning reference, a distillation teacher):
    # the trainer puts them on the device in eval mode without gradients and wraps them for inference;
    # they are never optimised or saved. The loss reaches them by name from its closure.
    frozen: dict[str, nn.Module] = field(default_factory=dict)
    # how many items a batch's loss averages over (SFT: its trained tokens), as a tensor; set, the
    # trainer weighs each micro-batch by it, so the gradient is the mean over every item of the
    # global (accumulated, all-process) batch whatever grad_accum is, and held-out means are per item
    loss_weight: Callable[[Batch], Tensor] | None = None
    files: dict[str, str] = field(
        default_factory=dict
    )  # name -> text the run directory keeps (DPO's reference log-probs)
    # parameters of the model the loss never reads (a BERT pooler that mean pooling does not call): the
    # driver freezes them, so that no strategy trains, counts or expects optimizer state for them
    unread: tuple = ()
    # what the memory plan runs the loss on in place of a drawn batch (a rollout's, DPO's longest pair)
    plan_batch: Callable[[Batch], Batch] | None = None
    head_lr: float = 0.0  # the heads' learning rate (a classifier's head_lr; 0: optim.lr)
    # the deepest block the loss reads features of (a classifier's layer): the memory plan's probes keep it
    blocks_read: int = 1
    # whether the task has held-out examples to evaluate on; False (every held-out row skipped): the
    # driver says so before step 1, and the run keeps no best checkpoint and writes no final report
    held_out: bool = True
    online: OnPolicy | None = None  # a task that samples its own training data (GRPO)

    @property
    def curve(self) -> str:
        """The metric the run's curves.png draws."""
        return self.online.curve if self.online else "loss"


@dataclass
class OnPolicy:
    """What a task that samples its own training data asks of the trainer (GRPO): `rollout(module,
    batches) -> (batches, metrics)` turns one step's drawn batches (prompts) into what the loss reads
    (sampled completions, their rewards and advantages), with the model as it is now and without
    gradients; the same rollouts train `reuse` steps in a row (a checkpoint between them keeps them, so
    a resumed run trains on the same ones)."""

    rollout: Callable[[nn.Module, list], tuple[list, dict[str, Tensor]]]
    reuse: int = 1
    curve: str = "reward"  # the metric its curves.png draws (sampled and held-out)
    shown: tuple[str, ...] = ()  # the metrics its log line shows (metrics.jsonl keeps every one)


class Plugin:
    """Base of every objective and task: class attributes describe it, methods do the work."""

    key: ClassVar[str]
    kind: ClassVar[str]  # "objective" | "task"
    model_kinds: ClassVar[tuple[str, ...]] = ()  # the model kinds it trains (models.kinds), in order of preference
    recipe_pattern: ClassVar[str] = ""  # its default recipe's name for a family, e.g. "classify-{family}-mini"
    families: ClassVar[tuple[str, ...]] = ()  # derived: the families of its model kinds
    Config: ClassVar[type | None] = None  # its recipe section (named like the key), if any
    recipes: ClassVar[dict[str, str]] = {}  # derived: family -> its shipped default recipe (the first: the plug-in's)
    describe: ClassVar[str] = ""  # a few words for the banner, e.g. "BERT MLM + NSP"
    streaming: ClassVar[bool] = False  # whether it can read data.streaming sources
    reads_text: ClassVar[bool] = True  # False: a text family's model without a tokenizer (ImageGPT reads colours)
    takes_images: ClassVar[bool] = False  # it trains a model that reads images (models.vlm) on rows that hold them

    def __init__(self, rt: Runtime, quiet: bool = False, named_code: frozenset[str] = frozenset()):
        self.rt, self.quiet = rt, quiet
        self.named_code = named_code  # as EvalOptions.named_code: what this command's own command line names
        self.run_dir: Path | None = None  # the run a training job writes (set before setup; its files exist on resume)

    def __init_subclass__(cls, **kwargs):
        """A plug-in names model kinds, never families: the families (a new one included) and their
        shipped default recipes follow from the kinds and the recipe pattern (a family whose models read
        images only for a plug-in that takes them)."""
        super().__init_subclass__(**kwargs)
        if "model_kinds" in cls.__dict__ or "recipe_pattern" in cls.__dict__ or "takes_images" in cls.__dict__:
            cls.families = tuple(
                f for f in families_of(cls.model_kinds) if cls.takes_images or not kinds.reads_images(model_class(f))
            )
            cls.recipes = shipped_recipes(cls.recipe_pattern, cls.families)

    @classmethod
    def default_recipe(cls, family: str | None = None) -> str:
        return cls.recipes.get(family or "", next(iter(cls.recipes.values())))

    def title(self, recipe, backbone) -> str:
        """What this run does, for the banner."""
        return self.describe

    def special_tokens(self, family: str) -> list[str]:
        """What a tokenizer for this family must hold: the family's own special tokens."""
        return list(model_class(family).special_tokens)

    def tokenizer_texts(self, recipe) -> Iterable[str]:
        return ()

    def tokenizer_key(self, recipe) -> str | None:
        """A fingerprint of the text tokenizer_texts reads, to cache a trained tokenizer by (None: never)."""
        return None

    def model_shape(self, recipe):
        """The model a fresh run builds (the recipe's; ImageGPT sets its vocabulary and context)."""
        return recipe.model

    def resolve(self, recipe, backbone):
        """The recipe this run saves, given its backbone: the backbone's own model shape, so that the
        run describes itself (plug-ins may take more from it)."""
        return replace(recipe, model=backbone.cfg)

    def frozen_copies(self, recipe) -> int:
        """How many frozen copies of the starting model the run will hold (a reference model): the
        memory floor counts them before anything is read."""
        return 0

    def setup(self, recipe, backbone) -> Job:
        raise NotImplementedError

    def report(self, recipe, run_dir: Path) -> dict[str, Any]:
        """The final report after training (rank 0); nothing by default."""
        return {}

    def hints(self, run_dir: Path) -> list[str]:
        return [f"evaluate it:  tfcli eval --checkpoint {run_dir}"]

    def next_commands(self, run_dir: Path, evaluated: bool = True) -> list[str]:
        """hints(run_dir), less its evaluation when the run had nothing held out (it would not run)."""
        return [h for h in self.hints(run_dir) if evaluated or not h.startswith("evaluate it")]

    def evaluate(self, recipe, backbone, options: EvalOptions) -> dict[str, Any]:
        raise NotImplementedError


@dataclass
class Backbone:
    """A model with its tokenizer, and where it came from."""

    model: Any  # an nn.Module of a tfcli family (models.kinds: what each kind offers)
    tokenizer: Any  # TextTokenizer, or None for image models
    source: str = "scratch"  # "scratch", a tfcli run or checkpoint, or a Hugging Face directory
    heads: dict[str, Tensor] = field(default_factory=dict)  # head weights that came with it (no "heads." prefix)
    recipe: Any = None  # the recipe of the tfcli run it came from
    checkpoint: Path | None = None  # the checkpoint it was read from
    labels: tuple[str, ...] = ()  # a classifier's class names, in id order
    resumed: bool = False  # a run being resumed: the model's weights come from its checkpoint, after setup
    run_dir: Path | None = None  # the tfcli run it was read from (its files: tokenizer, palette, run.json)

    @property
    def cfg(self):
        return self.model.cfg

    @property
    def family(self) -> str:
        return self.model.cfg.family
