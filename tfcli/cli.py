"""The `tfcli` command: each subcommand resolves a recipe, applies overrides and calls the driver.

One vocabulary of flags wherever a model runs: --seed, --device, --precision, --quiet; `--set
key=value` or a bare `key=value` overrides any recipe field. Heavy modules (torch, the driver) are
imported by the commands that need them, so that --help and shell completion answer at once.
"""
from __future__ import annotations

import functools
import os
import sys
from pathlib import Path
from typing import List, Optional

import typer
from typer._click import exceptions as click_errors  # typer vendors click

from . import __version__
from . import registry
from .errors import Interrupted, UserError


def _lazy(name: str):
    """A module imported when first used (importlib's LazyLoader): tfcli.recipe reads the model
    families, which import torch, and --help must not wait for that."""
    import importlib.util

    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.find_spec(name)
    spec.loader = importlib.util.LazyLoader(spec.loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


recipes = _lazy("tfcli.recipe")


def task_target(name: str):
    from .tasks.presets import task_target as target

    return target(name)

app = typer.Typer(no_args_is_help=True, pretty_exceptions_enable=False, rich_markup_mode=None,
                  help="Pretrain, finetune, evaluate and sample transformers.")
recipes_app = typer.Typer(add_completion=False, rich_markup_mode=None, help="List or show recipes.")
app.add_typer(recipes_app, name="recipes")
TRAINING = {"allow_extra_args": True, "ignore_unknown_options": True}  # bare key=value overrides

SET_HELP = "Override any recipe field, e.g. --set optim.lr=3e-4 (repeatable; a bare optim.lr=3e-4 works too)."
SEED = typer.Option(None, help="Random seed [default: the recipe's train.seed; 0 for eval].")
DEVICE = typer.Option(None, help="auto | cpu | cuda | cuda:N [default: the recipe's train.device; auto].")
PRECISION = typer.Option(None, help="auto (bf16 on a GPU that has it, else fp32) | fp32 | bf16 [default: the recipe's train.precision].")
QUIET = typer.Option(False, "--quiet", help="Print nothing but errors and the final summary.")
CHECKPOINT = typer.Option(None, help="Run or checkpoint directory [default: the newest run under runs/, named].")


def _version(value: bool) -> None:
    if value:
        import torch

        typer.echo(f"tfcli {__version__} (torch {torch.__version__}, Python {sys.version.split()[0]})")
        raise typer.Exit()


@app.callback()
def _options(version: Optional[bool] = typer.Option(None, "--version", callback=_version, is_eager=True,
                                                     help="Print tfcli's version and exit.")):
    """Pretrain, finetune, evaluate and sample transformers."""


def user_errors(fn):
    """One surface for errors: a UserError is `error: <message>` on stderr and exit code 2; a stop on
    Ctrl-C after a checkpoint says how to resume (exit 130); anything else is one line naming where
    the traceback was written (exit 1; TFCLI_DEBUG=1 prints it instead)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except UserError as e:
            typer.echo(f"error: {one_line(str(e))}", err=True)
            raise typer.Exit(2)
        except Interrupted as e:
            typer.echo(f"interrupted at step {e.step}: a checkpoint was saved; resume with "
                       f"tfcli {fn.__name__} --resume {e.run_dir}", err=True)
            raise typer.Exit(130)
        except (typer.Exit, typer.Abort, KeyboardInterrupt, click_errors.ClickException):
            raise
        except Exception as e:
            if os.environ.get("TFCLI_DEBUG", "0") not in ("0", ""):
                raise
            typer.echo(f"error: internal error ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}); "
                       f"the traceback is in {write_traceback()} (TFCLI_DEBUG=1 prints it)", err=True)
            raise typer.Exit(1)
    return wrapper


def one_line(message: str, most: int = 600) -> str:
    """An error message as one line of bounded length, whatever data went into it."""
    text = " ".join(message.split())
    return text if len(text) <= most else f"{text[: most - 40]} … {text[-35:]}"


def write_traceback() -> Path:
    """The current exception's traceback, written where a bug report can pick it up."""
    import traceback

    from .data.sources import cache_dir

    path = cache_dir() / "last-error.txt"
    path.write_text(traceback.format_exc())
    return path


def overrides(sets: list[str], extra: list[str]) -> list[str]:
    """--set values and bare key=value arguments (torchtune's form), which win in the order given."""
    for arg in extra:
        if arg.startswith("-"):
            raise UserError(f"no such option: {arg.split('=')[0]} (--help lists the options)")
        if "=" not in arg:
            raise UserError(f"unexpected argument {arg!r} (overrides look like key.path=value)")
    return [*sets, *extra]


def resolve_recipe(name: str, sets: list[str], shortcuts: dict) -> recipes.Recipe:
    """Load a recipe and apply --set overrides, then the short flags (which win)."""
    values = dict(recipes.parse_override(s) for s in sets)
    values.update({k: v for k, v in shortcuts.items() if v is not None})
    return recipes.load(name, values)


def training_recipe(default: str, recipe: Optional[str], resume: Optional[str], sets: list[str],
                    shortcuts: dict) -> tuple[recipes.Recipe, Optional[Path]]:
    """The recipe of a new run (--recipe, else `default`), or of the run being resumed (its config.yaml);
    `--resume auto` is the newest unfinished run of that recipe under runs/."""
    if resume is None:
        return resolve_recipe(recipe or default, sets, shortcuts), None
    if resume == "auto":
        from .runs import newest_unfinished

        resume = str(newest_unfinished(Path("runs"), recipes.load_raw(recipe or default)["name"]))
        _note(f"resuming the newest unfinished run of this recipe: {resume}")
    config = Path(resume) / "config.yaml"
    if not config.is_file():
        raise UserError(f"--resume {resume}: no config.yaml there; is it a tfcli run?")
    try:
        recipes.load(str(config))
    except UserError as e:
        raise UserError(f"--resume {resume}: config.yaml is not a tfcli recipe ({e})") from None
    rec = resolve_recipe(str(config), sets, {k: v for k, v in shortcuts.items() if k not in ("objective", "task")})
    refuse_retroactive_changes(recipes.load(str(config)), rec, resume)
    if recipe and recipe not in (rec.name, "auto"):
        _note(f"resuming with the run's own recipe {rec.name!r}, not {recipe!r}")
    return rec, Path(resume)


def refuse_retroactive_changes(saved: recipes.Recipe, asked: recipes.Recipe, run: str) -> None:
    """A resumed run continues what it saved (optimizer state, schedule, data order, model): an
    override of those would be written to config.yaml without being what ran. Only how long and how
    it runs may change (recipes.RESUMABLE_CHANGES)."""
    wrong = [c for c in recipes.changes(saved, asked) if c[0] not in recipes.RESUMABLE_CHANGES]
    if wrong:
        field, old, new = wrong[0]
        more = f" (and {len(wrong) - 1} more)" if len(wrong) > 1 else ""
        raise UserError(f"--resume {run}: {field} was {old!r} and cannot change when resuming{more}; a resumed run "
                        f"continues its saved optimizer, schedule and data (it may change train.steps, intervals, "
                        f"device and threads); start a new run for {field}={new!r}")


def _note(text: str) -> None:
    typer.echo(f"note: {text}", err=True)


def newest(checkpoint: Optional[Path], families: tuple[str, ...] = ()) -> Path:
    """--checkpoint, or the newest run under runs/ (of `families` when given), named so that nobody
    wonders which it was."""
    if checkpoint is not None:
        return checkpoint
    from .checkpoint import newest_run

    run = newest_run(families=families)
    _note(f"using the newest run{' that can generate' if families else ''}: {run}")
    return run


def check_device(device: Optional[str]) -> None:
    import torch

    if device and device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {device}: no CUDA device is available here (use cpu)")


def run_training(rec: recipes.Recipe, source: Optional[str], out: Optional[Path], resume: Optional[Path],
                 quiet: bool) -> None:
    from .display import console
    from .driver import RunRequest, train

    run_dir, plugin = train(RunRequest(rec, source, out, resume, quiet))
    if int(os.environ.get("RANK", "0")) == 0:  # once under torchrun
        console.print(f"\n[bold green]done.[/] run: {run_dir}\n" + "\n".join(plugin.hints(run_dir)))


@app.command(context_settings=TRAINING)
@user_errors
def pretrain(
    ctx: typer.Context,
    objective: Optional[str] = typer.Option(None, help="clm (GPT next-token) | mlm | span | mae | electra [default: the recipe's; clm]."),
    recipe: Optional[str] = typer.Option(None, help="Recipe name or a YAML path [default: the objective's]."),
    data: Optional[str] = typer.Option(None, help="Training data: builtin, builtin:NAME, files/globs/dirs, or hf:name[:config] [default: the recipe's data.source]."),
    steps: Optional[int] = typer.Option(None, help="Optimizer steps [default: the recipe's train.steps]."),
    batch_size: Optional[int] = typer.Option(None, help="Per-process batch size [default: the recipe's train.batch_size]."),
    lr: Optional[float] = typer.Option(None, help="Peak learning rate [default: the recipe's optim.lr]."),
    out: Optional[Path] = typer.Option(None, help="Run directory [default: runs/<recipe>-<time>]."),
    resume: Optional[str] = typer.Option(None, help="Continue this run from its latest checkpoint; auto: the newest unfinished run of the recipe."),
    from_: Optional[str] = typer.Option(None, "--from", help="Continue pretraining these weights: a tfcli run, a Hugging Face directory or hub id [default: a fresh model; --objective defaults to the family's]."),
    no_nsp: bool = typer.Option(False, "--no-nsp", help="mlm: RoBERTa style, full segments and no next-sentence prediction (mlm.nsp=false)."),
    seed: Optional[int] = SEED, device: Optional[str] = DEVICE, precision: Optional[str] = PRECISION,
    set_: List[str] = typer.Option([], "--set", help=SET_HELP), quiet: bool = QUIET,
):
    """Pretrain a model with an objective (GPT next-token, BERT MLM+NSP, T5 span corruption, ViT MAE,
    ELECTRA), from scratch or (--from) continuing a pretrained model's weights."""
    from_ = continued_from(from_, resume)
    if from_ is not None and objective is None and recipe is None:
        objective = family_objective(from_)
    default = registry.plugin_class("objective", objective or "clm").default_recipe()
    shortcuts = {"objective": objective, "data.source": data, "train.steps": steps, "train.batch_size": batch_size,
                 "optim.lr": lr, "train.device": device, "train.precision": precision, "train.seed": seed}
    rec, resume_dir = training_recipe(default, recipe, resume, overrides(set_, ctx.args), shortcuts)
    if no_nsp:
        if rec.objective != "mlm":
            raise UserError("--no-nsp applies to --objective mlm only")
        rec = recipes.replace(rec, settings=recipes.replace(rec.settings, nsp=False))
    run_training(rec, from_, out, resume_dir, quiet)


def continued_from(source: Optional[str], resume: Optional[str]) -> Optional[str]:
    """--from of `pretrain`: a local path, or a hub id resolved to its snapshot."""
    if source is None:
        return None
    if resume is not None:
        raise UserError("--from starts a new run from those weights; --resume continues a run (give one)")
    from .hub import resolve

    return str(resolve(source))


def family_objective(source: str) -> str:
    """The objective a model family pretrains with (next-token for a GPT, MLM for a BERT, ...)."""
    from .backbone import family_of, unknown_source

    family = family_of(source)
    if family is None:
        raise unknown_source("--from", source)
    return registry.objective_for(family)


@app.command()
@user_errors
def prepare(
    data: str = typer.Option(..., help="Documents: builtin, files/globs/dirs (comma-separated), or hf:name[:config[:split]]."),
    tokenizer: str = typer.Option(..., help="gpt2 or bert-base-uncased (shipped), a tokenizer.json or a directory of tokenizer files, or a tfcli run."),
    out: Path = typer.Option(..., help="The store's directory (new or empty)."),
    objective: str = typer.Option("clm", help="What it is for: clm and span store a token stream; mlm and electra store sentences."),
    workers: int = typer.Option(0, help="Tokenizing processes [default: one per core, at most 8]."),
    text_field: str = typer.Option("text", help="The column holding the text in JSON Lines, CSV and parquet files."),
    paragraphs: bool = typer.Option(False, "--paragraphs", help="mlm/electra: every blank-line paragraph is a document."),
    quiet: bool = QUIET,
):
    """Tokenize a corpus once, in parallel, to a token store on disk; `pretrain --data OUT` trains on it."""
    from .data.documents import open_source
    from .data.store import prepare as prepare_store
    from .data.tokenizers import load_tokenizer_files
    from .display import configure, console
    from .driver import new_run_dir
    from .models import TEXT_FAMILIES

    import torch

    from .runtime import Runtime

    configure(not quiet)
    plugin = registry.plugin_class("objective", objective)(Runtime(torch.device("cpu")), quiet)
    if not set(plugin.families) & set(TEXT_FAMILIES):
        raise UserError(f"--objective {objective}: images are read as they are; prepare is for text")
    specials = plugin.special_tokens(plugin.families[0])
    out = new_run_dir(recipes.load(plugin.default_recipe()), out)
    source = tokenizer if "/" in tokenizer or Path(tokenizer).exists() else f"builtin:{tokenizer}"
    tok = load_tokenizer_files(source, specials)
    sentences = objective in ("mlm", "electra")
    store = prepare_store(open_source(data, text_field), tok, out, workers=workers, quiet=quiet,
                          mode=("paragraphs" if paragraphs else "sentences") if sentences else "text", eos=not sentences)
    if not quiet:
        console.print(f"{out}: {len(store):,} tokens ({store.index['dtype']})\n"
                      f"train on it:  tfcli pretrain --objective {objective} --data {out}")


def run_task(run: Path) -> str:
    """The task a finetuning run trains (`finetune --resume RUN` needs no task argument)."""
    config = run / "config.yaml"
    if not config.is_file():
        raise UserError(f"--resume {run}: no config.yaml there; is it a tfcli run?")
    task = recipes.load_raw(str(config)).get("task")
    if not task:
        raise UserError(f"--resume {run} is a pretraining run; continue it with tfcli pretrain --resume {run}")
    return task


@app.command(context_settings=TRAINING)
@user_errors
def finetune(
    ctx: typer.Context,
    task: Optional[str] = typer.Argument(None, help=f"Task: {', '.join(registry.TASKS)}, or a preset (mnli, gsm8k) [default with --resume: the run's]."),
    from_: Optional[str] = typer.Option(None, "--from", help="A tfcli run or a Hugging Face model directory [default: the recipe's model, randomly initialised]."),
    recipe: Optional[str] = typer.Option(None, help="Recipe name or YAML path [default: the task's for the --from model's family]."),
    data: Optional[str] = typer.Option(None, help="Task data: a file, a directory of split files, or hf:name [default: the recipe's data.source]."),
    steps: Optional[int] = typer.Option(None, help="Optimizer steps; given, it wins over epochs [default: the recipe's train.steps]."),
    epochs: Optional[float] = typer.Option(None, help="Epochs over the training rows [default: the recipe's finetune.epochs]."),
    batch_size: Optional[int] = typer.Option(None, help="Per-process batch size [default: the recipe's train.batch_size]."),
    lr: Optional[float] = typer.Option(None, help="Peak learning rate [default: the recipe's optim.lr]."),
    train: Optional[str] = typer.Option(None, help="all | head | lora | ia3 | bitfit: what trains [default: the recipe's finetune.train]."),
    head: Optional[str] = typer.Option(None, help="classifier | text: a classifier on pooled features, or the label word as text (T5, GPT) [default: the recipe's finetune.head]."),
    pooling: Optional[str] = typer.Option(None, help="cls | mean | last | last4-sum | last4-concat | encoder-mean | decoder-first [default: the recipe's finetune.pooling]."),
    head_lr: Optional[float] = typer.Option(None, help="Learning rate of the head (finetune.head_lr; 0 = --lr)."),
    layer: Optional[int] = typer.Option(None, help="The depth a classifier reads: -1 the last block, n the n-th (0: the embeddings) (finetune.layer)."),
    limit: Optional[int] = typer.Option(None, help="Use only the first N training rows [default: the recipe's finetune.limit]."),
    text_fields: Optional[str] = typer.Option(None, help="classify: the column(s) holding the text, e.g. title,body (classify.text_fields)."),
    label_field: Optional[str] = typer.Option(None, help="classify: the column holding the label (classify.label_field)."),
    prompt_field: Optional[str] = typer.Option(None, help="sft: the column holding the prompt (sft.prompt_field) [default: prompt]."),
    response_field: Optional[str] = typer.Option(None, help="sft: the column holding the reply (sft.response_field) [default: completion]."),
    chat_template: Optional[str] = typer.Option(None, help="sft: a chat template tfcli ships (chatml, llama-3-instruct, ...), a .jinja file, or none (sft.chat_template) [default: the model's own]."),
    train_on: Optional[str] = typer.Option(None, help="sft: which tokens are learned: assistant (every reply), last (the last reply), all (sft.train_on)."),
    pack: Optional[bool] = typer.Option(None, "--pack/--no-pack", help="sft: several examples per row, each attending only to itself (sft.pack)."),
    out: Optional[Path] = typer.Option(None, help="Run directory [default: runs/<recipe>-<time>]."),
    resume: Optional[str] = typer.Option(None, help="Continue this run from its latest checkpoint; auto: the newest unfinished run of the recipe."),
    seed: Optional[int] = SEED, device: Optional[str] = DEVICE, precision: Optional[str] = PRECISION,
    set_: List[str] = typer.Option([], "--set", help=SET_HELP), quiet: bool = QUIET,
):
    """Finetune a pretrained model on a task."""
    from .backbone import family_of
    from .hub import resolve

    from_ = str(resolve(from_)) if from_ else None  # a hub id: its snapshot in the Hugging Face cache
    if task is None and resume in (None, "auto"):
        raise UserError("name the task to finetune on (e.g. tfcli finetune mnli --from RUN), or give --resume RUN")
    key, settings, defaults = task_target(task) if task is not None else (run_task(Path(resume)), {}, {})
    family = family_of(from_)
    default = defaults.get(family or "", next(iter(defaults.values()), ""))
    shortcuts = {"task": key, "data.source": data, "train.steps": steps, "finetune.epochs": epochs,
                 "train.batch_size": batch_size, "optim.lr": lr, "finetune.pooling": pooling, "finetune.train": train, "finetune.head": head,
                 "finetune.head_lr": head_lr, "finetune.layer": layer, "finetune.limit": limit, "train.device": device,
                 "train.precision": precision, "train.seed": seed, **{f"{key}.{k}": v for k, v in settings.items()}}
    if steps is not None and epochs is None:
        shortcuts["finetune.epochs"] = 0.0  # --steps wins over the recipe's epochs
    if text_fields is not None or label_field is not None:
        shortcuts.update({f"{key}.text_fields": text_fields, f"{key}.label_field": label_field})
    sft_flags = {"prompt_field": prompt_field, "response_field": response_field, "chat_template": chat_template,
                 "train_on": train_on, "pack": pack}
    given = [name for name, value in sft_flags.items() if value is not None]
    if given and key != "sft":
        raise UserError(f"--{given[0].replace('_', '-')} is an option of finetune sft (this is {task or key})")
    shortcuts.update({f"sft.{name}": sft_flags[name] for name in given})
    sets = overrides(set_, ctx.args)
    rec, resume_dir = training_recipe(default, recipe, resume, sets, shortcuts)
    if resume_dir is None and not quiet:
        given = {recipes.parse_override(s)[0] for s in sets} | {k for k, v in shortcuts.items() if v is not None}
        applied = recipes.strategy_defaults({"strategies": rec.strategies, "finetune": {"train": rec.finetune.train}}, given)
        if applied:
            _note(f"--train {rec.finetune.train} uses its defaults " + ", ".join(f"{k}={v}" for k, v in applied.items())
                  + f" (the recipe's strategies.{rec.finetune.train}; a flag or --set wins)")
    run_training(rec, from_, out, resume_dir, quiet)


@app.command("eval")
@user_errors
def eval_(
    task: Optional[str] = typer.Argument(None, help="What to evaluate as (mnli, classify, image-classify, mae, ...); omit for the run's own objective or task."),
    checkpoint: Optional[Path] = CHECKPOINT,
    data: Optional[str] = typer.Option(None, help="Evaluate on this data instead of the run's."),
    batches: int = typer.Option(0, help="Held-out batches for pretraining runs (0: the recipe's train.eval_batches)."),
    limit: int = typer.Option(0, help="A seeded, class-balanced sample of N examples of each split (0: all)."),
    out: Optional[Path] = typer.Option(None, help="Write the report (or the MAE picture) here [default: beside the run, eval-<what>.json]."),
    premise: Optional[str] = typer.Option(None, help="MNLI: classify this premise ..."),
    hypothesis: Optional[str] = typer.Option(None, help="... with this hypothesis, and print the label probabilities."),
    input_: List[str] = typer.Option([], "--input", help="Classify this input (repeat for a pair's second text)."),
    few_shot: int = typer.Option(-1, help="Score an un-finetuned decoder/encoder-decoder with k solved examples in the prompt (-1: off)."),
    cloze: bool = typer.Option(False, "--cloze", help="Zero-shot BERT: label words scored at a [MASK] in a template by the MLM head."),
    seed: int = typer.Option(0, help="Seed for sampled examples (few-shot, --limit, masking)."),
    device: Optional[str] = DEVICE, precision: Optional[str] = PRECISION, quiet: bool = QUIET,
    set_: List[str] = typer.Option([], "--set", help="A setting of the evaluated task, e.g. --set sft.max_new_tokens=64 (repeatable)."),
    reference: Optional[str] = typer.Option(None, help="dpo: the model rewards are measured against [default: the run's reference]."),
):
    """Metrics of a run (or of a Hugging Face model as a task): held-out loss and perplexity, or a task's report."""
    from .driver import evaluate
    from .plugin import EvalOptions

    if (premise is None) != (hypothesis is None):
        raise UserError("give both --premise and --hypothesis, or neither")
    check_device(device)
    inputs = tuple(input_) + ((premise, hypothesis) if premise is not None else ())
    if cloze and few_shot >= 0:
        raise UserError("--cloze and --few-shot are two ways of zero/few-shot scoring; give one")
    key, settings, defaults = None, {}, {}
    if task is not None:
        key, settings, defaults = (task, {}, {}) if task in registry.OBJECTIVES else task_target(task)
    for item in set_:  # the evaluated task's own settings (how long replies are, ...): not training's
        path, value = recipes.parse_override(item)
        section, _, name = path.partition(".")
        if not name or (key is not None and section != key):
            raise UserError(f"--set {item}: eval takes settings of the task it runs, e.g. --set "
                            f"{key or 'sft'}.max_new_tokens=64")
        settings[name] = value
    evaluate(newest(checkpoint), key, settings, EvalOptions(
        data=data, limit=limit, batches=batches, out=out, inputs=inputs, few_shot=few_shot, cloze=cloze, seed=seed,
        device=device or "auto", precision=precision, quiet=quiet, reference=reference), defaults)


@app.command()
@user_errors
def export(
    hf: Optional[Path] = typer.Option(None, "--hf", help="Write a Hugging Face transformers directory here."),
    gguf: Optional[Path] = typer.Option(None, "--gguf", help="Write a GGUF file here (llama-family runs: llama.cpp, Ollama, tfcli)."),
    gguf_type: str = typer.Option("f16", "--gguf-type", help="GGUF matrices: f32, f16 or q8_0 (norms stay f32)."),
    peft: Optional[Path] = typer.Option(None, "--peft", help="A LoRA run: write its adapters, unmerged, as a PEFT directory here."),
    checkpoint: Optional[Path] = CHECKPOINT,
):
    """Export a run (its best checkpoint, else its latest) as a directory transformers can load, or a GGUF file."""
    from . import hf as hf_interop
    from .backbone import from_run
    from .display import console

    if hf is None and gguf is None and peft is None:
        raise UserError("name what to write: --hf DIR (transformers), --gguf FILE (llama.cpp) and/or --peft DIR "
                        "(a LoRA run's adapters)")
    if gguf is not None and gguf_type not in hf_interop.gguf.WRITE_TYPES:
        raise UserError(f"--gguf-type {gguf_type}: choose {', '.join(hf_interop.gguf.WRITE_TYPES)}")
    if gguf is not None and gguf.exists():
        raise UserError(f"{gguf} exists; choose a new --gguf file")
    if hf is not None:
        hf_interop.convert.check_writable(hf)
    backbone = from_run(newest(checkpoint), which="best")
    if peft is not None:  # first: the adapters unmerged (the other exports merge them into the model)
        from .backbone import recorded
        from .checkpoint import run_dir_of

        base = recorded(run_dir_of(backbone.checkpoint)).get("from") or "(the run's base model)"
        loads_with = hf_interop.export_peft(backbone, backbone.recipe, base, peft)
        console.print(f"wrote LoRA adapters to {peft}\nload them with:  {loads_with}", soft_wrap=True)
    if hf is not None:
        arch, loads_with = hf_interop.export(backbone, backbone.recipe, hf)
        console.print(f"wrote {arch} to {hf}\nload it with:  {loads_with}", soft_wrap=True)
    if gguf is not None:
        arch = hf_interop.export_gguf(backbone, backbone.recipe, gguf, gguf_type)
        console.print(f"wrote a {gguf_type} GGUF ({arch}) to {gguf}\nrun it with:  tfcli generate --checkpoint {gguf}",
                      soft_wrap=True)


SAMPLING_HELP = dict(
    max_new_tokens="Most tokens to generate.", temperature="Sampling temperature; 0 is greedy.",
    top_k="Sample among the k most likely tokens (0: all).",
    top_p="Nucleus sampling: smallest set with this much probability (1: off).")
GENERATOR_HELP = "A run or checkpoint, a Hugging Face directory, a GGUF file or a hub id in the local cache " \
                 "[default: the newest run under runs/ that can generate]."
TEMPLATE_HELP = "A chat template tfcli ships (chatml, llama-3-instruct, ...) or a .jinja file [default: the model's own]."
GENERATOR = typer.Option(None, help=GENERATOR_HELP)
CHAT_TEMPLATE = typer.Option(None, help=TEMPLATE_HELP)
TOP_K = typer.Option(50, help=SAMPLING_HELP["top_k"])
GREEDY = typer.Option(False, "--greedy", help="Always take the most likely token (same as --temperature 0).")
SAMPLING_SEED = typer.Option(None, help="Random seed for reproducible samples [default: unseeded].")


def generator(command: str, checkpoint: Optional[Path], device: Optional[str], kinds_wanted=None):
    """(the backbone a generating command runs, its device): a decoder or encoder-decoder, refused in
    one line otherwise."""
    from .backbone import for_inference
    from .models import families_of, kinds
    from .runtime import pick_device

    wanted = kinds_wanted or kinds.GENERATIVE
    check_device(device)
    dev = pick_device(device or "auto")
    backbone = for_inference(newest(checkpoint, families=families_of(wanted)), device=str(dev))
    if backbone.model.kind not in wanted:
        described = " or ".join(f"{k} ({', '.join(families_of((k,)))})" for k in wanted)
        raise UserError(f"{backbone.checkpoint} holds a {backbone.family!r} model; {command} needs a {described} checkpoint")
    return backbone, dev


def check_sampling(max_new_tokens: int, temperature: float, top_k: int, top_p: float) -> None:
    if max_new_tokens < 0 or temperature < 0 or top_k < 0 or not 0 < top_p <= 1:
        raise UserError("--max-new-tokens, --temperature and --top-k must be >= 0 and --top-p in (0, 1]")


@app.command()
@user_errors
def generate(
    prompt: str = typer.Option("", help="Text to continue (with --chat: the user's message)."),
    checkpoint: Optional[Path] = GENERATOR,
    chat: bool = typer.Option(False, "--chat", help="Answer --prompt as one chat turn, in the model's chat template."),
    system: Optional[str] = typer.Option(None, help="--chat: a system message first."),
    chat_template: Optional[str] = CHAT_TEMPLATE,
    max_new_tokens: int = typer.Option(200, help=SAMPLING_HELP["max_new_tokens"]),
    temperature: float = typer.Option(0.8, help=SAMPLING_HELP["temperature"]),
    top_k: int = TOP_K,
    top_p: float = typer.Option(1.0, help=SAMPLING_HELP["top_p"]),
    greedy: bool = GREEDY,
    no_cache: bool = typer.Option(False, "--no-cache", help="Recompute every position each step (for checking the cache)."),
    seed: Optional[int] = SAMPLING_SEED,
    images: int = typer.Option(0, help="An igpt run: complete the bottom half of N held-out images and draw N samples, as a PNG grid."),
    out: Optional[Path] = typer.Option(None, help="--images: the PNG to write [default: RUN/samples.png]."),
    device: Optional[str] = DEVICE, precision: Optional[str] = PRECISION, quiet: bool = QUIET,
):
    """Generate text from a decoder (or encoder-decoder) checkpoint, streaming tokens as they are made;
    or, from an ImageGPT run (--images N), images."""
    from .data.chat import for_model
    from .generate import reply, stream
    from .models import kinds
    from .runtime import autocast_context

    check_sampling(max_new_tokens, temperature, top_k, top_p)
    backbone, dev = generator("generate --chat" if chat else "generate", checkpoint, device,
                              (kinds.DECODER,) if chat else None)
    reads_colours = backbone.recipe is not None and backbone.recipe.objective == "igpt"
    if images > 0 or reads_colours:
        if not reads_colours:
            raise UserError(f"--images needs an igpt run (tfcli pretrain --objective igpt); {backbone.checkpoint} "
                            f"holds a text model")
        from .checkpoint import run_dir_of
        from .objectives.igpt import sample_grid

        path = sample_grid(backbone, images or 8, out or run_dir_of(Path(backbone.checkpoint)) / "samples.png",
                           0.0 if greedy else temperature, top_k, seed or 0)
        typer.echo(f"wrote {path}")
        return
    sampling = dict(max_new_tokens=max_new_tokens, temperature=0.0 if greedy else temperature, top_k=top_k,
                    top_p=top_p, use_cache=not no_cache, seed=seed)
    if chat:
        if not prompt:
            raise UserError("--chat answers --prompt: give the user's message")
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        pieces = reply(backbone, for_model(backbone.tokenizer, chat_template), messages, **sampling)
    else:
        pieces = stream(backbone, prompt, **sampling)
    with autocast_context(precision or "fp32", dev):
        for text in pieces:
            sys.stdout.write(text)
            sys.stdout.flush()
    sys.stdout.write("\n")


@app.command("chat")
@user_errors
def chat_command(
    checkpoint: Optional[Path] = GENERATOR,
    chat_template: Optional[str] = CHAT_TEMPLATE,
    greedy: bool = GREEDY,
    max_new_tokens: int = typer.Option(256, help=SAMPLING_HELP["max_new_tokens"]),
    temperature: float = typer.Option(0.7, help=SAMPLING_HELP["temperature"]),
    top_k: int = TOP_K,
    top_p: float = typer.Option(0.9, help=SAMPLING_HELP["top_p"]),
    system: Optional[str] = typer.Option(None, help="A system message, kept through /reset."),
    seed: Optional[int] = SAMPLING_SEED,
    device: Optional[str] = DEVICE, precision: Optional[str] = PRECISION,
):
    """Chat with a decoder (a run, a Hugging Face directory or a GGUF) in its chat template: replies stream;
    Ctrl-C stops a reply, /reset starts over, /exit, Ctrl-D or Ctrl-C at the prompt ends."""
    from .data.chat import for_model
    from .generate import reply
    from .models import kinds
    from .runtime import autocast_context

    check_sampling(max_new_tokens, temperature, top_k, top_p)
    backbone, dev = generator("chat", checkpoint, device, (kinds.DECODER,))
    template = for_model(backbone.tokenizer, chat_template)
    start = [{"role": "system", "content": system}] if system else []
    messages = list(start)
    sampling = dict(max_new_tokens=max_new_tokens, temperature=0.0 if greedy else temperature, top_k=top_k,
                    top_p=top_p, seed=seed)
    interactive = sys.stdin.isatty()
    if interactive:
        sys.stdout.write(f"chatting with {backbone.checkpoint} (Ctrl-C stops a reply, /reset starts over, "
                         f"/exit or Ctrl-D ends)\n")
    while True:
        if interactive:
            sys.stdout.write("> ")
            sys.stdout.flush()
        try:
            line = sys.stdin.readline()
        except KeyboardInterrupt:  # Ctrl-C at the prompt (a second one, after a stopped reply): the end
            sys.stdout.write("\n")
            return
        if not line or line.strip() == "/exit":
            return
        if line.strip() == "/reset":
            messages = list(start)
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line.rstrip("\n")})
        answer = []
        try:
            with autocast_context(precision or "fp32", dev):
                for text in reply(backbone, template, messages, **sampling):
                    answer.append(text)
                    sys.stdout.write(text)
                    sys.stdout.flush()
        except KeyboardInterrupt:  # Ctrl-C stops this reply (what it wrote is kept) and returns to the prompt
            sys.stdout.write(" [stopped]")
        sys.stdout.write("\n")
        messages.append({"role": "assistant", "content": "".join(answer)})


@app.command()
@user_errors
def compare(
    task: Optional[str] = typer.Option(None, help="Task(s), comma-separated: mnli, classify, image-classify, sft, gsm8k, dpo."),
    from_: Optional[str] = typer.Option(None, "--from", help="The models, comma-separated: tfcli runs, Hugging Face directories or hub ids."),
    train: Optional[str] = typer.Option(None, help="Strategies, comma-separated: all, head, lora, ia3, bitfit; X+head (a classifier head, e.g. lora+head), X:POOLING (head:mean), Kshot (prompting, nothing trained: 0shot,4shot) [default: all]."),
    budget: Optional[str] = typer.Option(None, help="Each cell's budget: 500steps, 10000ex (one epoch over N rows), 10m / 1h (training time) or 1epoch [default: 1epoch]."),
    data: Optional[str] = typer.Option(None, help="Task data for every cell [default: each recipe's]."),
    lr: Optional[str] = typer.Option(None, help="Learning rate per strategy, e.g. all=5e-5,lora=5e-4 [default: the recipe's]."),
    grid: Optional[Path] = typer.Option(None, help="A YAML file with tasks, from, train, budget, data, lr and set; flags win."),
    out: Path = typer.Option(..., help="The study's directory: cells/, logs/, results.md, results.csv, results.png."),
    set_: List[str] = typer.Option([], "--set", help="key.path=value for every cell (repeatable)."),
    vary: List[str] = typer.Option([], "--vary", help="key.path=v1,v2: run every training cell at each value, e.g. --vary dpo.beta=0.1,0.3 (repeatable: all combinations)."),
    report_limit: Optional[int] = typer.Option(None, help="Score every cell on the same balanced sample of N examples of each evaluation split [default: all of them]."),
    quiet: bool = QUIET,
):
    """Finetune (or prompt) every model with every strategy to the same budget and tabulate the results."""
    from . import compare as study
    from .display import configure, console

    configure(not quiet)
    spec = study.load_grid(grid, task, from_, train, budget, data, lr, set_, report_limit, vary)
    if not quiet:
        varied = "".join(f" x {len(v)} {k}" for k, v in spec.vary.items())
        console.print(f"{len(spec.cells())} cells ({len(spec.tasks)} task(s) x {len(spec.backbones)} model(s) x "
                      f"{len(spec.strategies)} strategies{varied}), {spec.budget} each, in {out}")
    rows = study.run_grid(spec, out, quiet)
    md, csv_path = study.write_tables(rows, out)
    picture = study.chart(rows, out)
    if not quiet:
        study.show(rows)
        console.print(f"wrote {md}, {csv_path}" + (f" and {picture}" if picture else ""))
    failed = [r for r in rows if r.get("status") != "done"]
    if failed:
        raise UserError(f"{len(failed)} of {len(rows)} cells did not finish (see {out}/logs); run the same command again to retry them")


@app.command(context_settings=TRAINING)
@user_errors
def probe(
    ctx: typer.Context,
    task: str = typer.Argument(..., help="What to probe for: a preset (mnli), classify (your labelled text) or image-classify."),
    from_: str = typer.Option(..., "--from", help="The model(s), comma-separated: tfcli runs, Hugging Face directories or hub ids, GGUF files."),
    data: Optional[str] = typer.Option(None, help="The task's data, as finetune reads it [default: the recipe's]."),
    layers: str = typer.Option("all", help="all, or depths such as 0,3,6 (0: the embeddings, n: the n-th block)."),
    pooling: str = typer.Option("mean", help="mean (of tokens or patches), last (a decoder's last token) or cls (an encoder's first)."),
    method: str = typer.Option("ridge", help="ridge (closed form, its penalty picked on a fifth of the training set) or logistic (L-BFGS)."),
    limit: int = typer.Option(2000, help="Training examples for the probes: a seeded, class-balanced sample (0: all)."),
    eval_limit: int = typer.Option(1000, help="Examples of each evaluation split (0: all)."),
    out: Path = typer.Option(Path("probe"), help="Directory for probe.json and probe.png."),
    seed: int = typer.Option(0, help="Seed of the samples."),
    set_: List[str] = typer.Option([], "--set", help="A recipe field for reading the data, e.g. --set classify.text_fields=[title] (repeatable)."),
):
    """A linear probe on every layer: how much of a task each depth of a model holds (features cached)."""
    from .probe import ProbeRequest, run

    sets = dict(recipes.parse_override(x) for x in overrides(set_, ctx.args))
    sources = [str(resolve_hub(x)) for x in from_.split(",") if x.strip()]
    run(ProbeRequest(task, sources, data, layers, pooling, method, limit, eval_limit, sets, out, seed))


def resolve_hub(source: str) -> Path:
    from .hub import resolve

    return resolve(source.strip())


@app.command()
@user_errors
def runs(root: Path = typer.Argument(Path("runs"), help="The directory holding the runs.")):
    """List the runs: name, family, objective or task, steps done, best metric, when."""
    from rich.table import Column, Table

    from .display import console
    from .runs import age, list_runs

    table = Table(Column("run", no_wrap=True), "family", "objective / task", "steps", "best", "when")
    for info in list_runs(root):
        table.add_row(info.path.name, info.family, info.what, f"{info.step:,}/{info.steps:,}", info.best, age(info.when))
    console.print(table)


@app.command()
@user_errors
def plot(
    run: List[Path] = typer.Argument(..., help="One or more run directories."),
    out: Path = typer.Option(Path("runs.png"), help="Where to write the PNG."),
    metric: str = typer.Option("loss", help="The metric to draw (loss, mlm_loss, dev_matched_acc, ...)."),
    split: str = typer.Option("val", help="val | train: which rows to draw (train when a run has no val rows)."),
):
    """Overlay the runs' loss curves (or another metric) in one PNG."""
    from .display import console
    from .plots import compare_runs, run_curves

    path = run_curves(run[0], out, metric) if len(run) == 1 else compare_runs(run, out, metric, split)
    console.print(f"wrote {path}")


@app.command()
@user_errors
def upgrade(run: Path = typer.Argument(..., help="A run directory whose checkpoints hold state.pt (tfcli before 0.2).")):
    """Convert a run's pickled training state (state.pt) to state.safetensors + state.json, reading it
    with torch's weights_only loader: a pickle that carries code is refused, not run."""
    from .checkpoint import upgrade_legacy
    from .display import console

    done = upgrade_legacy(run)
    console.print(f"converted {len(done)} checkpoint(s) of {run}" if done else f"{run}: nothing to convert")


@recipes_app.callback(invoke_without_command=True)
def recipes_list(ctx: typer.Context):
    """List the shipped recipes."""
    if ctx.invoked_subcommand is not None:
        return
    from rich.table import Column, Table

    from .display import console

    table = Table(Column("recipe", no_wrap=True), "objective / task", "model", "steps", "batch", "lr")
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
        code = 0
    except click_errors.ClickException as e:
        typer.echo(f"error: {e.format_message()}", err=True)
        code = 2
    except typer.Exit as e:
        code = e.exit_code
    except (KeyboardInterrupt, typer.Abort):
        typer.echo("interrupted", err=True)
        code = 130
    leave(code if isinstance(code, int) else 0)


def leave(code: int) -> None:
    """Exit. A process that torchrun started skips C++ static destructors (os._exit after flushing):
    with gloo, one of them sometimes finds a thread still joinable and aborts a run that has finished
    and saved everything (about 1 in 10 FSDP runs on a busy 2-core machine), which fails the job."""
    if "TORCHELASTIC_RUN_ID" in os.environ or int(os.environ.get("WORLD_SIZE", "1")) > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
