"""pretrain, prepare and finetune: a recipe resolved from its name, --set and the shortcut flags, run by the driver."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer

from .. import registry
from ..errors import UserError
from .common import (
    DEVICE,
    DRY_RUN,
    PRECISION,
    QUIET,
    SEED,
    SET_HELP,
    named_code,
    note,
    overrides,
    recipes,
    refuse_model_sets,
    run_training,
    task_target,
    training_recipe,
    user_errors,
)
from .flags import recipe_flags

if TYPE_CHECKING:
    from ..engine.model_source import ModelSource


@recipe_flags(
    "data.source:data",
    "train.steps",
    "train.batch_size",
    "optim.lr",
    after="recipe",
    leads={"data.source": "training data: builtin, builtin:NAME, files/globs/dirs, a token store, or hf:name[:config]"},
)
@user_errors
def pretrain(
    ctx: typer.Context,
    objective: str | None = typer.Option(
        None, help="clm (GPT next-token) | mlm | span | mae | electra | igpt [default: the recipe's; clm]."
    ),
    recipe: str | None = typer.Option(None, help="Recipe name or a YAML path [default: the objective's]."),
    out: Path | None = typer.Option(None, help="Run directory [default: runs/<recipe>-<time>]."),
    resume: str | None = typer.Option(
        None, help="Continue this run from its latest checkpoint; auto: the newest unfinished run of the recipe."
    ),
    from_: str | None = typer.Option(
        None,
        "--from",
        help="Continue pretraining these weights: a tfcli run, a Hugging Face directory or hub id [default: a fresh model; --objective defaults to the family's].",
    ),
    no_nsp: bool = typer.Option(
        False, "--no-nsp", help="mlm: RoBERTa style, full segments and no next-sentence prediction (mlm.nsp=false)."
    ),
    seed: int | None = SEED,
    device: str | None = DEVICE,
    precision: str | None = PRECISION,
    set_: list[str] = typer.Option([], "--set", help=SET_HELP),
    quiet: bool = QUIET,
    dry_run: bool = DRY_RUN,
    shortcuts: dict | None = None,
):
    """Pretrain a model with an objective (GPT next-token, BERT MLM+NSP, T5 span corruption, ViT MAE,
    ELECTRA), from scratch or (--from) continuing a pretrained model's weights."""
    source = continued_from(from_, resume)
    if source is not None and objective is None and recipe is None:
        objective = registry.objective_for(source.family)  # the objective the family pretrains with
    default = registry.plugin_class("objective", objective or "clm").default_recipe()
    shortcuts = {
        **shortcuts,
        "objective": objective,
        "train.device": device,
        "train.precision": precision,
        "train.seed": seed,
    }
    sets = overrides(set_, ctx.args)
    refuse_model_sets(sets, source)
    rec, resume_dir = training_recipe(default, recipe, resume, sets, shortcuts)
    if no_nsp:
        if rec.objective != "mlm":
            raise UserError("--no-nsp applies to --objective mlm only")
        rec = recipes.replace(rec, settings=recipes.replace(rec.settings, nsp=False))
    return run_training(rec, source, out, resume_dir, quiet, dry_run)


def continued_from(source: str | None, resume: str | None) -> ModelSource | None:
    """--from of `pretrain`: a local path, or a hub id resolved to its snapshot."""
    if source is None:
        return None
    if resume is not None:
        raise UserError("--from starts a new run from those weights; --resume continues a run (give one)")
    from ..engine import model_source

    return model_source.resolve(source)


@user_errors
def prepare(
    data: str = typer.Option(
        ..., help="Documents: builtin, files/globs/dirs (comma-separated), or hf:name[:config[:split]]."
    ),
    tokenizer: str = typer.Option(
        ...,
        help="gpt2 or bert-base-uncased (shipped), a tokenizer.json or a directory of tokenizer files, or a tfcli run.",
    ),
    out: Path = typer.Option(..., help="The store's directory (new or empty)."),
    objective: str = typer.Option(
        "clm", help="What it is for: clm and span store a token stream; mlm and electra store sentences."
    ),
    workers: int = typer.Option(
        0, help="Tokenizing processes [default: one per core, at most 8; this one below 6M characters]."
    ),
    text_field: str = typer.Option("text", help="The column holding the text in JSON Lines, CSV and parquet files."),
    paragraphs: bool = typer.Option(
        False, "--paragraphs", help="mlm/electra: every blank-line paragraph is a document."
    ),
    quiet: bool = QUIET,
):
    """Tokenize a corpus once, in parallel, to a token store on disk; `pretrain --data OUT` trains on it."""
    import torch

    from ..data.documents import open_source
    from ..data.store import prepare as prepare_store
    from ..data.tokenizers import load_tokenizer_files
    from ..display import configure, console
    from ..driver import new_run_dir
    from ..engine.runtime import Runtime
    from ..models import TEXT_FAMILIES

    configure(not quiet)
    plugin = registry.plugin_class("objective", objective)(Runtime(torch.device("cpu")), quiet)
    if not set(plugin.families) & set(TEXT_FAMILIES):
        raise UserError(f"--objective {objective}: images are read as they are; prepare is for text")
    specials = plugin.special_tokens(plugin.families[0])
    out = new_run_dir(recipes.load(plugin.default_recipe()), out)
    source = tokenizer if "/" in tokenizer or Path(tokenizer).exists() else f"builtin:{tokenizer}"
    tok = load_tokenizer_files(source, specials)
    sentences = objective in ("mlm", "electra")
    store = prepare_store(
        open_source(data, text_field),
        tok,
        out,
        workers=workers,
        quiet=quiet,
        mode=("paragraphs" if paragraphs else "sentences") if sentences else "text",
        eos=not sentences,
    )
    if not quiet:
        console.print(
            f"{out}: {len(store):,} tokens ({store.index['dtype']})\n"
            f"train on it:  tfcli pretrain --objective {objective} --data {out}"
        )


def run_task(run: Path) -> str:
    """The task a finetuning run trains (`finetune --resume RUN` needs no task argument)."""
    config = run / "config.yaml"
    if not config.is_file():
        raise UserError(f"--resume {run}: no config.yaml there; is it a tfcli run?")
    task = recipes.load_raw(str(config)).get("task")
    if not task:
        raise UserError(f"--resume {run} is a pretraining run; continue it with tfcli pretrain --resume {run}")
    return task


FINETUNE_FLAGS = (
    "data.source:data",
    "train.steps",
    "finetune.epochs",
    "train.batch_size",
    "optim.lr",
    "finetune.train",
    "classify.head",
    "classify.pooling",
    "classify.head_lr",
    "classify.layer",
    "finetune.limit",
    "classify.text_fields",
    "classify.label_field",
    "sft.prompt_field",
    "sft.response_field",
    "sft.chat_template",
    "sft.system",
    "sft.train_on",
    "sft.pack",
    "grpo.reward",
    "grpo.tools",
    "grpo.env",
    "distill.teacher",
)


def bound_to_task(shortcuts: dict, key: str, task: str) -> dict:
    """A task's flags (--text-fields, --pack, --chat-template, ...) set the chosen task's field of that
    name: --chat-template is sft.chat_template for sft and dpo.chat_template for dpo; a flag the chosen
    task has no field for is one line naming the tasks it is for."""
    import dataclasses

    config = registry.plugin_class("task", key).Config
    own = {f.name for f in dataclasses.fields(config)} if config else set()
    out = {}
    for path, value in shortcuts.items():
        section, _, name = path.partition(".")
        if section not in registry.TASKS or section == key:
            out[path] = value
        elif value is None:
            continue
        elif name in own:
            out[f"{key}.{name}"] = value
        else:
            users = [t for t in registry.TASKS if name in _field_names(t)]
            raise UserError(
                f"--{name.replace('_', '-')} is an option of finetune {' and '.join(users)} (this is {task})"
            )
    return out


def _field_names(task: str) -> set[str]:
    import dataclasses

    config = registry.plugin_class("task", task).Config
    return {f.name for f in dataclasses.fields(config)} if config else set()


@recipe_flags(
    *FINETUNE_FLAGS,
    after="recipe",
    leads={
        "data.source": "task data: a file, a directory of split files, or hf:name",
        "train.steps": "optimizer steps; given, they win over finetune.epochs",
    },
)
@user_errors
def finetune(
    ctx: typer.Context,
    task: str | None = typer.Argument(
        None, help=f"Task: {', '.join(registry.TASKS)}, or a preset (mnli, gsm8k) [default with --resume: the run's]."
    ),
    from_: str | None = typer.Option(
        None,
        "--from",
        help="A tfcli run or a Hugging Face model directory [default: the recipe's model, randomly initialised].",
    ),
    recipe: str | None = typer.Option(
        None, help="Recipe name or YAML path [default: the task's for the --from model's family]."
    ),
    vision_from: str | None = typer.Option(
        None,
        "--vision-from",
        help="A ViT (an MAE or image-classify run, or a ViT directory) joined to the --from decoder by a fresh "
        "projector: a LLaVA-style vision-language model (sft).",
    ),
    out: Path | None = typer.Option(None, help="Run directory [default: runs/<recipe>-<time>]."),
    resume: str | None = typer.Option(
        None, help="Continue this run from its latest checkpoint; auto: the newest unfinished run of the recipe."
    ),
    seed: int | None = SEED,
    device: str | None = DEVICE,
    precision: str | None = PRECISION,
    set_: list[str] = typer.Option([], "--set", help=SET_HELP),
    quiet: bool = QUIET,
    dry_run: bool = DRY_RUN,
    shortcuts: dict | None = None,
):
    """Finetune a pretrained model on a task."""
    from ..engine import model_source
    from ..models import COMPOSED

    source = model_source.resolve(from_) if from_ else None  # a hub id: its snapshot in the Hugging Face cache
    vision = model_source.resolve(vision_from, "--vision-from") if vision_from else None
    if task is None and resume in (None, "auto"):
        raise UserError("name the task to finetune on (e.g. tfcli finetune mnli --from RUN), or give --resume RUN")
    key, settings, defaults = task_target(task) if task is not None else (run_task(Path(resume)), {}, {})
    family = COMPOSED if vision else source.family if source else None
    default = defaults.get(family or "", next(iter(defaults.values()), ""))
    shortcuts = bound_to_task(shortcuts, key, task or key)
    if shortcuts["train.steps"] is not None and shortcuts["finetune.epochs"] is None:
        shortcuts = {**shortcuts, "finetune.epochs": 0.0}  # --steps wins over the recipe's epochs
    shortcuts = {
        **shortcuts,
        "task": key,
        "train.device": device,
        "train.precision": precision,
        "train.seed": seed,
        **{f"{key}.{k}": v for k, v in settings.items()},
    }
    sets = overrides(set_, ctx.args)
    refuse_model_sets(sets, source, vision)
    named = {recipes.parse_override(s)[0] for s in sets}
    if "train.steps" in named and "finetune.epochs" not in named and shortcuts["finetune.epochs"] is None:
        shortcuts = {**shortcuts, "finetune.epochs": 0.0}  # --set train.steps wins as --steps does
    rec, resume_dir = training_recipe(default, recipe, resume, sets, shortcuts)
    if resume_dir is None and not quiet:
        given = {recipes.parse_override(s)[0] for s in sets} | {k for k, v in shortcuts.items() if v is not None}
        applied = recipes.method_defaults({"methods": rec.methods, "finetune": {"train": rec.finetune.train}}, given)
        if applied:
            note(
                f"--train {rec.finetune.train} uses its defaults "
                + ", ".join(f"{k}={v}" for k, v in applied.items())
                + f" (the recipe's methods.{rec.finetune.train}; a flag or --set wins)"
            )
    return run_training(rec, source, out, resume_dir, quiet, dry_run, named_code(shortcuts, sets), vision)
