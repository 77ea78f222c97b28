"""The `tfcli` command: each subcommand resolves a recipe, applies overrides and calls the driver.

Commands import the driver (and with it torch) when they run, not when the program starts, so
that `--help` answers at once.
"""
from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import List, Optional

import typer
from typer._click import exceptions as click_errors  # typer vendors click

from . import recipe as recipes
from . import registry
from .errors import UserError
from .tasks.presets import PRESETS

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  rich_markup_mode=None, help="Pretrain, finetune, evaluate and sample transformers.")
recipes_app = typer.Typer(add_completion=False, rich_markup_mode=None, help="List or show recipes.")
app.add_typer(recipes_app, name="recipes")

SET_HELP = "Override any recipe field, e.g. --set optim.lr=3e-4 (repeatable)."


def user_errors(fn):
    """Turn UserError into `error: <message>` on stderr and exit code 2."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except UserError as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(2)
    return wrapper


def resolve_recipe(name: str, sets: list[str], shortcuts: dict) -> recipes.Recipe:
    """Load a recipe and apply --set overrides, then the short flags (which win)."""
    overrides = dict(recipes.parse_override(s) for s in sets)
    overrides.update({k: v for k, v in shortcuts.items() if v is not None})
    return recipes.load(name, overrides)


def training_recipe(default: str, recipe: Optional[str], resume: Optional[Path], sets: list[str],
                    shortcuts: dict) -> recipes.Recipe:
    """The recipe of a new run (--recipe, else `default`), or of the run being resumed (its config.yaml)."""
    if resume is None:
        return resolve_recipe(recipe or default, sets, shortcuts)
    config = Path(resume) / "config.yaml"
    if not config.is_file():
        raise UserError(f"--resume {resume}: no config.yaml there; is it a tfcli run?")
    rec = resolve_recipe(str(config), sets, {k: v for k, v in shortcuts.items() if k not in ("objective", "task")})
    if recipe and recipe != rec.name:
        from .display import console
        console.print(f"[yellow]note:[/] resuming with the run's own recipe {rec.name!r}, not {recipe!r}")
    return rec


def run_training(rec: recipes.Recipe, source: Optional[str], out: Optional[Path], resume: Optional[Path],
                 quiet: bool) -> None:
    from .display import console
    from .driver import RunRequest, train

    run_dir, plugin = train(RunRequest(rec, source, out, resume, quiet))
    console.print(f"\n[bold green]done.[/] run: {run_dir}\n" + "\n".join(plugin.hints(run_dir)))


@app.command()
@user_errors
def pretrain(
    objective: Optional[str] = typer.Option(None, help="clm (GPT next-token) | mlm | span | mae | electra [default: the recipe's; clm]."),
    recipe: Optional[str] = typer.Option(None, help="Recipe name in recipes/ or a YAML path [default: the objective's]."),
    data: Optional[str] = typer.Option(None, help="Training data: builtin, files/globs/dirs, or hf:name[:config] [default: the recipe's data.source]."),
    steps: Optional[int] = typer.Option(None, help="Optimizer steps [default: the recipe's train.steps]."),
    batch_size: Optional[int] = typer.Option(None, help="Per-process batch size [default: the recipe's train.batch_size]."),
    lr: Optional[float] = typer.Option(None, help="Peak learning rate [default: the recipe's optim.lr]."),
    out: Optional[Path] = typer.Option(None, help="Run directory [default: runs/<recipe>-<time>]."),
    resume: Optional[Path] = typer.Option(None, help="Continue the run in this directory from its latest checkpoint [default: start a new run]."),
    device: Optional[str] = typer.Option(None, help="auto | cpu | cuda [default: the recipe's train.device]."),
    precision: Optional[str] = typer.Option(None, help="fp32 | bf16 [default: the recipe's train.precision]."),
    no_nsp: bool = typer.Option(False, "--no-nsp", help="mlm: RoBERTa style, full segments and no next-sentence prediction (mlm.nsp=false)."),
    set_: List[str] = typer.Option([], "--set", help=SET_HELP),
    quiet: bool = typer.Option(False, "--quiet", help="Print nothing but errors and the final summary."),
):
    """Pretrain a model with an objective (GPT next-token, BERT MLM+NSP, T5 span corruption, ViT MAE, ELECTRA)."""
    default = registry.plugin_class("objective", objective or "clm").default_recipe()
    shortcuts = {"objective": objective, "data.source": data, "train.steps": steps, "train.batch_size": batch_size,
                 "optim.lr": lr, "train.device": device, "train.precision": precision}
    rec = training_recipe(default, recipe, resume, set_, shortcuts)
    if no_nsp:
        if rec.objective != "mlm":
            raise UserError("--no-nsp applies to --objective mlm only")
        rec = recipes.replace(rec, settings=recipes.replace(rec.settings, nsp=False))
    run_training(rec, None, out, resume, quiet)


def task_target(name: str) -> tuple[str, dict, dict]:
    """(task key, its recipe-section overrides, default recipes by family) for a task or a preset."""
    if name in PRESETS:
        p = PRESETS[name]
        return p.task, {"preset": name}, p.recipes
    if name not in registry.TASKS:
        raise UserError(f"unknown task {name!r} (known: {', '.join(sorted([*registry.TASKS, *PRESETS]))})")
    return name, {}, registry.plugin_class("task", name).recipes


@app.command()
@user_errors
def finetune(
    task: str = typer.Argument(..., help="Task: classify, image-classify, or a preset such as mnli."),
    from_: Optional[str] = typer.Option(None, "--from", help="A tfcli run or a Hugging Face model directory [default: the recipe's model, randomly initialised]."),
    recipe: Optional[str] = typer.Option(None, help="Recipe name or YAML path [default: the task's for the --from model's family]."),
    data: Optional[str] = typer.Option(None, help="Task data: a file, a directory of split files, or hf:name [default: the recipe's data.source]."),
    steps: Optional[int] = typer.Option(None, help="Optimizer steps; given, it wins over epochs [default: the recipe's train.steps]."),
    epochs: Optional[float] = typer.Option(None, help="Epochs over the training rows [default: the recipe's finetune.epochs]."),
    batch_size: Optional[int] = typer.Option(None, help="Per-process batch size [default: the recipe's train.batch_size]."),
    lr: Optional[float] = typer.Option(None, help="Peak learning rate [default: the recipe's optim.lr]."),
    pooling: Optional[str] = typer.Option(None, help="cls | mean | last4-sum | last4-concat [default: the recipe's finetune.pooling]."),
    train: Optional[str] = typer.Option(None, help="all | head: finetune everything or only the head [default: the recipe's finetune.train]."),
    head_lr: Optional[float] = typer.Option(None, help="Learning rate of the head (finetune.head_lr; 0 = --lr)."),
    limit: Optional[int] = typer.Option(None, help="Use only the first N training rows [default: the recipe's finetune.limit]."),
    text_fields: Optional[str] = typer.Option(None, help="classify: the column(s) holding the text, e.g. title,body (classify.text_fields)."),
    label_field: Optional[str] = typer.Option(None, help="classify: the column holding the label (classify.label_field)."),
    out: Optional[Path] = typer.Option(None, help="Run directory [default: runs/<recipe>-<time>]."),
    resume: Optional[Path] = typer.Option(None, help="Continue the finetuning run in this directory from its latest checkpoint."),
    device: Optional[str] = typer.Option(None, help="auto | cpu | cuda [default: the recipe's train.device]."),
    set_: List[str] = typer.Option([], "--set", help=SET_HELP),
    quiet: bool = typer.Option(False, "--quiet", help="Print nothing but errors and the final summary."),
):
    """Finetune a pretrained model on a task."""
    from .backbone import family_of

    key, settings, defaults = task_target(task)
    family = family_of(from_)
    default = defaults.get(family or "", next(iter(defaults.values())))
    shortcuts = {"task": key, "data.source": data, "train.steps": steps, "finetune.epochs": epochs,
                 "train.batch_size": batch_size, "optim.lr": lr, "finetune.pooling": pooling, "finetune.train": train,
                 "finetune.head_lr": head_lr, "finetune.limit": limit, "train.device": device,
                 **{f"{key}.{k}": v for k, v in settings.items()}}
    if steps is not None and epochs is None:
        shortcuts["finetune.epochs"] = 0.0  # --steps wins over the recipe's epochs
    if text_fields is not None or label_field is not None:
        shortcuts.update({f"{key}.text_fields": text_fields, f"{key}.label_field": label_field})
    rec = training_recipe(default, recipe, resume, set_, shortcuts)
    run_training(rec, from_, out, resume, quiet)


@app.command("eval")
@user_errors
def eval_(
    task: Optional[str] = typer.Argument(None, help="What to evaluate as (mnli, classify, image-classify, mae, ...); omit for the run's own objective or task."),
    checkpoint: Optional[Path] = typer.Option(None, help="Run or checkpoint directory [default: newest run]."),
    data: Optional[str] = typer.Option(None, help="Evaluate on this data instead of the run's."),
    batches: int = typer.Option(0, help="Held-out batches for pretraining runs (0: the recipe's train.eval_batches)."),
    limit: int = typer.Option(0, help="A seeded, class-balanced sample of N examples of each split (0: all)."),
    out: Optional[Path] = typer.Option(None, help="Write the report (or the MAE picture) here [default: beside the run, eval-<what>.json]."),
    premise: Optional[str] = typer.Option(None, help="MNLI: classify this premise ..."),
    hypothesis: Optional[str] = typer.Option(None, help="... with this hypothesis, and print the label probabilities."),
    input_: List[str] = typer.Option([], "--input", help="Classify this input (repeat for a pair's second text)."),
    few_shot: int = typer.Option(-1, help="Score an un-finetuned decoder/encoder-decoder with k solved examples in the prompt (-1: off)."),
    seed: int = typer.Option(0, help="Seed for sampled examples (few-shot, --limit, masking)."),
):
    """Metrics of a run: held-out loss and perplexity, or a task's report."""
    from .checkpoint import newest_run
    from .driver import evaluate
    from .plugin import EvalOptions

    if (premise is None) != (hypothesis is None):
        raise UserError("give both --premise and --hypothesis, or neither")
    inputs = tuple(input_) + ((premise, hypothesis) if premise is not None else ())
    key, settings = None, {}
    if task is not None:
        key, settings = (task, {}) if task in registry.OBJECTIVES else task_target(task)[:2]
    evaluate(checkpoint or newest_run(), key, settings, EvalOptions(data=data, limit=limit, batches=batches, out=out,
                                                                   inputs=inputs, few_shot=few_shot, seed=seed))


@app.command()
@user_errors
def export(
    hf: Path = typer.Option(..., "--hf", help="Write a Hugging Face transformers directory here."),
    checkpoint: Optional[Path] = typer.Option(None, help="Run or checkpoint directory [default: newest run]."),
):
    """Export a run (its best checkpoint, else its latest) as a directory transformers can load."""
    from . import hf as hf_interop
    from .backbone import from_run
    from .checkpoint import newest_run
    from .display import console

    backbone = from_run(checkpoint or newest_run(), which="best")
    arch = hf_interop.export(backbone, backbone.recipe, hf)
    console.print(f"wrote {arch} to {hf}")


@app.command()
@user_errors
def generate(
    prompt: str = typer.Option("", help="Text to continue."),
    checkpoint: Optional[Path] = typer.Option(None, help="Run or checkpoint directory [default: newest run]."),
    max_new_tokens: int = typer.Option(200, help="Most tokens to generate."),
    temperature: float = typer.Option(0.8, help="Sampling temperature; 0 is greedy."),
    top_k: int = typer.Option(50, help="Sample among the k most likely tokens (0: all)."),
    top_p: float = typer.Option(1.0, help="Nucleus sampling: smallest set with this much probability (1: off)."),
    greedy: bool = typer.Option(False, "--greedy", help="Always take the most likely token (same as --temperature 0)."),
    seed: Optional[int] = typer.Option(None, help="Random seed for reproducible samples [default: unseeded]."),
    no_cache: bool = typer.Option(False, "--no-cache", help="Recompute every position each step (for checking the cache)."),
    device: str = typer.Option("cpu", help="cpu | cuda."),
):
    """Generate text from a decoder (or encoder-decoder) checkpoint, streaming tokens as they are made."""
    from .backbone import from_run
    from .checkpoint import newest_run
    from .generate import stream

    if max_new_tokens < 0 or temperature < 0 or top_k < 0 or not 0 < top_p <= 1:
        raise UserError("--max-new-tokens, --temperature and --top-k must be >= 0 and --top-p in (0, 1]")
    backbone = from_run(checkpoint or newest_run(), device=device)
    if backbone.family not in ("gpt", "t5"):
        raise UserError(f"{backbone.checkpoint} holds a {backbone.family!r} model; "
                        f"generate needs a decoder (gpt) or encoder-decoder (t5) checkpoint")
    sampling = dict(max_new_tokens=max_new_tokens, temperature=0.0 if greedy else temperature, top_k=top_k,
                    top_p=top_p, use_cache=not no_cache, seed=seed)
    for text in stream(backbone, prompt, **sampling):
        sys.stdout.write(text)
        sys.stdout.flush()
    sys.stdout.write("\n")


@recipes_app.callback(invoke_without_command=True)
def recipes_list(ctx: typer.Context):
    """List the recipes in recipes/."""
    if ctx.invoked_subcommand is not None:
        return
    from rich.table import Column, Table

    from .display import console

    table = Table("objective / task", "model", "steps", "batch", "lr")
    table.columns.insert(0, Column("recipe", no_wrap=True))
    for name in recipes.available():
        raw = recipes.load_raw(name)
        m, t, o = raw.get("model", {}), raw.get("train", {}), raw.get("optim", {})
        shape = f"{m.get('family', '?')} L{m.get('n_layer', '?')} d{m.get('d_model', '?')}"
        plugin = raw.get("objective") or raw.get("task", "")
        preset = (raw.get(plugin) or {}).get("preset") if isinstance(raw.get(plugin), dict) else None
        table.add_row(name, f"{plugin} ({preset})" if preset else str(plugin), shape, str(t.get("steps", "")),
                      str(t.get("batch_size", "")), str(o.get("lr", "")))
    console.print(table)


@recipes_app.command("show")
@user_errors
def recipes_show(name: str = typer.Argument(..., help="Recipe name or path.")):
    """Print a recipe fully resolved, every default filled in."""
    import yaml

    typer.echo(yaml.safe_dump(recipes.to_dict(recipes.load(name)), sort_keys=False), nl=False)


def main() -> None:
    """Entry point: usage errors too become one line and exit code 2."""
    try:
        code = app(standalone_mode=False)
    except click_errors.NoArgsIsHelpError as e:
        typer.echo(e.ctx.get_help() if e.ctx else str(e))
        sys.exit(0)
    except click_errors.ClickException as e:
        typer.echo(f"error: {e.format_message()}", err=True)
        sys.exit(2)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except (KeyboardInterrupt, typer.Abort):
        typer.echo("interrupted", err=True)
        sys.exit(130)
    sys.exit(code if isinstance(code, int) else 0)
