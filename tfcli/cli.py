"""The `tfcli` command: each subcommand loads a recipe, applies overrides, calls one function."""
from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import List, Optional

import typer
from typer._click import exceptions as click_errors  # typer vendors click

from .errors import UserError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  rich_markup_mode=None, help="Pretrain, finetune, evaluate and sample transformers.")
recipes_app = typer.Typer(add_completion=False, rich_markup_mode=None, help="List or show recipes.")
app.add_typer(recipes_app, name="recipes")


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


def resolve_recipe(recipe_name: str, sets: list[str], **shortcuts):
    """Load a recipe and apply --set overrides, then the short flags (which win)."""
    from . import recipe as recipes

    overrides = dict(recipes.parse_override(s) for s in sets)
    overrides.update({k: v for k, v in shortcuts.items() if v is not None})
    return recipes.load(recipe_name, overrides)


SET_HELP = "Override any recipe field, e.g. --set optim.lr=3e-4 (repeatable)."


@app.command()
@user_errors
def pretrain(
    objective: str = typer.Option("clm", help="clm (GPT next-token) | mlm | span | mae."),
    recipe: Optional[str] = typer.Option(None, help="Recipe name in recipes/ or a YAML path [default: the objective's]."),
    data: Optional[str] = typer.Option(None, help="Training data: builtin, files/globs/dirs, or hf:name[:config] [default: the recipe's data.source]."),
    steps: Optional[int] = typer.Option(None, help="Optimizer steps [default: the recipe\'s train.steps]."),
    batch_size: Optional[int] = typer.Option(None, help="Per-process batch size [default: the recipe\'s train.batch_size]."),
    lr: Optional[float] = typer.Option(None, help="Peak learning rate [default: the recipe\'s optim.lr]."),
    out: Optional[Path] = typer.Option(None, help="Run directory [default: runs/<recipe>-<time>]."),
    resume: Optional[Path] = typer.Option(None, help="Continue the run in this directory from its latest checkpoint [default: start a new run]."),
    device: Optional[str] = typer.Option(None, help="auto | cpu | cuda [default: the recipe\'s train.device]."),
    precision: Optional[str] = typer.Option(None, help="fp32 | bf16 [default: the recipe\'s train.precision]."),
    no_nsp: bool = typer.Option(False, "--no-nsp", help="mlm: RoBERTa style, full segments and no next-sentence prediction (mlm.nsp=false)."),
    set_: List[str] = typer.Option([], "--set", help=SET_HELP),
    quiet: bool = typer.Option(False, "--quiet", help="Print nothing but errors and the final summary."),
):
    """Pretrain a model with an objective (GPT next-token, BERT MLM+NSP, T5 span corruption, ViT MAE)."""
    from . import objectives
    from . import recipe as recipes
    from .display import console
    from .pretrain import pretrain as run

    module = objectives.get(objective)
    shortcuts = {"data.source": data, "train.steps": steps, "train.batch_size": batch_size, "optim.lr": lr,
                 "train.device": device, "train.precision": precision}
    if no_nsp:
        if objective != "mlm":
            raise UserError("--no-nsp applies to --objective mlm only")
        shortcuts["mlm.nsp"] = False
    if resume is not None:
        config = Path(resume) / "config.yaml"
        if not config.is_file():
            raise UserError(f"--resume {resume}: no config.yaml there; is it a tfcli run?")
        rec = resolve_recipe(str(config), set_, **shortcuts)
        if recipe and recipe != rec.name:
            console.print(f"[yellow]note:[/] resuming with the run's own recipe {rec.name!r}, not {recipe!r}")
    else:
        rec = resolve_recipe(recipe or module.DEFAULT_RECIPE, set_, objective=objective, **shortcuts)
    run_dir = run(rec, out=out, resume=resume, quiet=quiet)
    if rec.objective == "mae":
        console.print(f"\n[bold green]done.[/] run: {run_dir}  (reconstructions: {run_dir}/recon.png)\n"
                      f"evaluate it:  tfcli eval mae --checkpoint {run_dir} --out recon.png\n"
                      f"probe it:     tfcli finetune image-classify --from {run_dir} --data ... --train head")
        return
    if rec.objective == "mlm":
        console.print(f"\n[bold green]done.[/] run: {run_dir}\n"
                      f"evaluate it:  tfcli eval --checkpoint {run_dir}\n"
                      f"finetune it:  tfcli finetune mnli --from {run_dir} --data ../shared/data/mnli")
        return
    console.print(f"\n[bold green]done.[/] run: {run_dir}\n"
                  f"generate from it:  tfcli generate --checkpoint {run_dir} --prompt \"...\"\n"
                  f"evaluate it:       tfcli eval --checkpoint {run_dir}")


@app.command()
@user_errors
def finetune(
    task: str = typer.Argument(..., help="Task to finetune on, e.g. mnli."),
    from_: Optional[Path] = typer.Option(None, "--from", help="A tfcli run or a Hugging Face model directory [default: the recipe's model, randomly initialised]."),
    recipe: Optional[str] = typer.Option(None, help="Recipe name or YAML path [default: the task's; mnli-t5-mini or mnli-gpt-mini when --from is a t5 or gpt run]."),
    data: Optional[str] = typer.Option(None, help="Task data directory or files [default: the recipe\'s task.data]."),
    steps: Optional[int] = typer.Option(None, help="Optimizer steps [default: the recipe\'s train.steps]."),
    epochs: Optional[float] = typer.Option(None, help="Epochs over the training rows [default: the recipe\'s task.epochs]."),
    batch_size: Optional[int] = typer.Option(None, help="Per-process batch size [default: the recipe\'s train.batch_size]."),
    lr: Optional[float] = typer.Option(None, help="Peak learning rate [default: the recipe\'s optim.lr]."),
    pooling: Optional[str] = typer.Option(None, help="cls | mean | last4-sum | last4-concat [default: the recipe\'s task.pooling]."),
    train: Optional[str] = typer.Option(None, help="all | head: finetune everything or only the head [default: the recipe\'s task.train]."),
    head_lr: Optional[float] = typer.Option(None, help="Learning rate of the head (task.head_lr; 0 = --lr)."),
    limit: Optional[int] = typer.Option(None, help="Use only the first N training rows [default: the recipe\'s task.limit]."),
    out: Optional[Path] = typer.Option(None, help="Run directory [default: runs/<recipe>-<time>]."),
    device: Optional[str] = typer.Option(None, help="auto | cpu | cuda [default: the recipe\'s train.device]."),
    set_: List[str] = typer.Option([], "--set", help=SET_HELP),
    quiet: bool = typer.Option(False, "--quiet", help="Print nothing but errors and the final summary."),
):
    """Finetune a pretrained model on a task."""
    from . import tasks
    from .display import console

    module = tasks.get(task)
    if not hasattr(module, "finetune"):
        raise UserError(f"task {task!r} can be evaluated but not finetuned")
    default = module.default_recipe(from_) if hasattr(module, "default_recipe") else module.DEFAULT_RECIPE
    rec = resolve_recipe(recipe or default, set_, **{
        "task.name": task, "task.data": data, "train.steps": steps, "task.epochs": epochs,
        "train.batch_size": batch_size, "optim.lr": lr, "task.pooling": pooling, "task.train": train,
        "task.head_lr": head_lr, "task.limit": limit, "train.device": device})
    run_dir = module.finetune(rec, from_=from_, out=out, quiet=quiet)
    console.print(f"\n[bold green]done.[/] run: {run_dir}\nevaluate it:  tfcli eval {task} --checkpoint {run_dir}")


@app.command("eval")
@user_errors
def eval_(
    task: Optional[str] = typer.Argument(None, help="Task to evaluate on (e.g. mnli, mae); omit for held-out loss of a pretraining run."),
    checkpoint: Optional[Path] = typer.Option(None, help="Run or checkpoint directory [default: newest run]."),
    data: Optional[str] = typer.Option(None, help="Evaluate on this data instead of the run's held-out split."),
    batches: int = typer.Option(0, help="Held-out batches for pretraining runs (0: the recipe's train.eval_batches)."),
    limit: int = typer.Option(0, help="Evaluate on the first N rows of each split (0: all)."),
    out: Optional[Path] = typer.Option(None, help="Write a picture or report here (e.g. the MAE reconstruction grid)."),
    premise: Optional[str] = typer.Option(None, help="MNLI: classify this premise ..."),
    hypothesis: Optional[str] = typer.Option(None, help="... with this hypothesis, and print the three probabilities."),
    few_shot: int = typer.Option(-1, help="Score an un-finetuned decoder/encoder-decoder with k solved examples in the prompt (-1: off)."),
    seed: int = typer.Option(0, help="Seed for sampled examples (few-shot, masking)."),
):
    """Metrics of a checkpoint: held-out loss and perplexity, or a task's metrics."""
    from .checkpoint import newest_run
    from .display import console

    path = checkpoint or newest_run()
    if task is not None:
        from . import tasks

        tasks.get(task).evaluate(path, tasks.EvalOptions(data=data, limit=limit, out=out, premise=premise,
                                                         hypothesis=hypothesis, few_shot=few_shot, seed=seed))
        return
    from .evaluate import evaluate_pretraining, metrics_table

    result = evaluate_pretraining(path, data=data, batches=batches)
    console.print(metrics_table(f"{path}", result))


@app.command()
@user_errors
def export(
    hf: Path = typer.Option(..., "--hf", help="Write a Hugging Face transformers directory here."),
    checkpoint: Optional[Path] = typer.Option(None, help="Run or checkpoint directory [default: newest run]."),
):
    """Export a run (its best checkpoint, else its latest) as a directory transformers can load."""
    from .checkpoint import newest_run
    from .display import console
    from .hf import export_run

    path = checkpoint or newest_run()
    arch = export_run(path, hf)
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
    import torch

    from .checkpoint import newest_run
    from .generate import TextStreamer, generate_tokens
    from .inference import load_run

    if max_new_tokens < 0 or temperature < 0 or top_k < 0 or not 0 < top_p <= 1:
        raise UserError("--max-new-tokens, --temperature and --top-k must be >= 0 and --top-p in (0, 1]")
    loaded = load_run(checkpoint or newest_run(), device=device)
    family = loaded.recipe.model.family
    if family not in ("gpt", "t5"):
        raise UserError(f"{loaded.checkpoint} holds a {family!r} model; "
                        f"generate needs a decoder (gpt) or encoder-decoder (t5) checkpoint")
    tok = loaded.tokenizer
    sampling = dict(max_new_tokens=max_new_tokens, temperature=0.0 if greedy else temperature, top_k=top_k,
                    top_p=top_p, eos_id=tok.eos_id, use_cache=not no_cache, seed=seed)
    if family == "t5":  # encode the prompt once, decode an answer from the start token
        from .seq2seq import generate_seq2seq

        if not prompt:
            raise UserError("give a --prompt: an encoder-decoder model answers an input, e.g. "
                            "\"Thank you <extra_id_0> me to your party <extra_id_1> week.\"")
        ids = torch.tensor([tok.encode(prompt) + [tok.eos_id]], device=device)  # T5 inputs end with </s>
        streamer = TextStreamer(lambda t: tok.decode(t, skip_special_tokens=False))  # show the sentinels
        tokens = generate_seq2seq(loaded.model, ids, start_id=tok.token_id("<pad>"), **sampling)
    else:
        ids = tok.encode(prompt) if prompt else []
        if not ids:
            if tok.eos_id is None:
                raise UserError("give a non-empty --prompt (this tokenizer has no end-of-text token to start from)")
            ids = [tok.eos_id]
        streamer = TextStreamer(tok.decode)
        sys.stdout.write(prompt)
        sys.stdout.flush()
        tokens = generate_tokens(loaded.model, torch.tensor([ids], device=device), **sampling)
    for token in tokens:
        sys.stdout.write(streamer.push(token))
        sys.stdout.flush()
    sys.stdout.write("\n")


@recipes_app.callback(invoke_without_command=True)
def recipes_list(ctx: typer.Context):
    """List the recipes in recipes/."""
    if ctx.invoked_subcommand is not None:
        return
    import yaml
    from rich.table import Table

    from . import recipe as recipes
    from .display import console

    table = Table("recipe", "objective", "model", "steps", "batch", "lr")
    for name in recipes.available():
        raw = yaml.safe_load(recipes.recipe_path(name).read_text()) or {}
        m, t, o = raw.get("model", {}), raw.get("train", {}), raw.get("optim", {})
        shape = f"{m.get('family', '?')} L{m.get('n_layer', '?')} d{m.get('d_model', '?')}"
        table.add_row(name, str(raw.get("objective", "")), shape, str(t.get("steps", "")),
                      str(t.get("batch_size", "")), str(o.get("lr", "")))
    console.print(table)


@recipes_app.command("show")
@user_errors
def recipes_show(name: str = typer.Argument(..., help="Recipe name or path.")):
    """Print a recipe fully resolved, every default filled in."""
    import yaml

    from . import recipe as recipes

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
