"""What every command shares: the options spelled once (--seed, --device, --precision, --quiet,
--checkpoint, --set), the one error surface (user_errors), and how a recipe is resolved from a recipe
name, --set overrides and the shortcut flags. Heavy modules are imported by the functions that need
them, so that --help and shell completion answer at once."""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from typer._click import exceptions as click_errors  # typer vendors click

from ..errors import Interrupted, UserError

if TYPE_CHECKING:
    from ..engine.model_source import ModelSource


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
    from ..tasks.presets import task_target as target

    return target(name)


TRAINING = {"allow_extra_args": True, "ignore_unknown_options": True}  # bare key=value overrides

SET_HELP = "Override any recipe field, e.g. --set optim.lr=3e-4 (repeatable; a bare optim.lr=3e-4 works too)."
SEED = typer.Option(None, help="Random seed [default: the recipe's train.seed; 0 for eval].")
DEVICE = typer.Option(None, help="auto | cpu | cuda | cuda:N [default: the recipe's train.device; auto].")
PRECISION = typer.Option(
    None, help="auto (bf16 on a GPU that has it, else fp32) | fp32 | bf16 [default: the recipe's train.precision]."
)
QUIET = typer.Option(False, "--quiet", help="Print nothing but errors and the final summary.")
DRY_RUN = typer.Option(
    False,
    "--dry-run",
    help="Print the run's memory plan (weights, gradients, optimizer, activations, against the device) and stop; nothing is trained or written.",
)

CHECKPOINT = typer.Option(None, help="Run or checkpoint directory [default: the newest run under runs/, named].")


def user_errors(fn):
    """One surface for errors: a UserError is `error: <message>` on stderr and exit code 2; a stop on
    Ctrl-C after a checkpoint says how to resume (exit 130); anything else is one line naming where
    the traceback was written (exit 1; TFCLI_DEBUG=1 prints it instead)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from ..display import configure

        configure(True)  # each command starts showing what it does (--quiet turns it off again)
        try:
            return fn(*args, **kwargs)
        except UserError as e:
            typer.echo(f"error: {one_line(str(e))}", err=True)
            raise typer.Exit(2) from None
        except Interrupted as e:
            typer.echo(
                f"interrupted at step {e.step}: a checkpoint was saved; resume with "
                f"tfcli {fn.__name__} --resume {e.run_dir}",
                err=True,
            )
            raise typer.Exit(130) from None
        except (typer.Exit, typer.Abort, KeyboardInterrupt, click_errors.ClickException):
            raise
        except Exception as e:
            if os.environ.get("TFCLI_DEBUG", "0") not in ("0", ""):
                raise
            typer.echo(
                f"error: internal error ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}); "
                f"the traceback is in {write_traceback()} (TFCLI_DEBUG=1 prints it)",
                err=True,
            )
            raise typer.Exit(1) from None

    return wrapper


def one_line(message: str, most: int = 600) -> str:
    """An error message as one line of bounded length, whatever data went into it."""
    text = " ".join(message.split())
    return text if len(text) <= most else f"{text[: most - 40]} … {text[-35:]}"


def write_traceback() -> Path:
    """The current exception's traceback, written where a bug report can pick it up."""
    import traceback

    from ..data.sources import cache_dir

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


def training_recipe(
    default: str, recipe: str | None, resume: str | None, sets: list[str], shortcuts: dict
) -> tuple[recipes.Recipe, Path | None]:
    """The recipe of a new run (--recipe, else `default`), or of the run being resumed (its config.yaml);
    `--resume auto` is the newest unfinished run of that recipe under runs/."""
    if resume is None:
        return resolve_recipe(recipe or default, sets, shortcuts), None
    if resume == "auto":
        from .runs import newest_unfinished

        resume = str(newest_unfinished(Path("runs"), recipes.load_raw(recipe or default)["name"]))
        note(f"resuming the newest unfinished run of this recipe: {resume}")
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
        note(f"resuming with the run's own recipe {rec.name!r}, not {recipe!r}")
    return rec, Path(resume)


def refuse_retroactive_changes(saved: recipes.Recipe, asked: recipes.Recipe, run: str) -> None:
    """A resumed run continues what it saved (optimizer state, schedule, data order, model): an
    override of those would be written to config.yaml without being what ran. Only how long and how
    it runs may change (recipes.resumable: the fields that say so)."""
    wrong = [c for c in recipes.changes(saved, asked) if c[0] not in recipes.resumable(saved)]
    if wrong:
        field, old, new = wrong[0]
        more = f" (and {len(wrong) - 1} more)" if len(wrong) > 1 else ""
        raise UserError(
            f"--resume {run}: {field} was {old!r} and cannot change when resuming{more}; a resumed run "
            f"continues its saved optimizer, schedule and data (it may change train.steps, intervals, "
            f"device and threads); start a new run for {field}={new!r}"
        )


def is_model_setting(key: str) -> bool:
    """A recipe key of the model section: what a model read --from keeps as it was saved."""
    return key.startswith("model.")


def refuse_model_sets(sets: list[str], source: ModelSource | None, vision: ModelSource | None = None) -> None:
    """--from gives the whole model: the run keeps the source's shape and settings (Plugin.resolve), so a
    --set model.* would be written on the command line and dropped from what runs. Refused, as a
    resumed run refuses one (a model joined by --vision-from takes the recipe's model settings)."""
    if source is None or vision is not None:
        return
    named = [s for s in sets if is_model_setting(recipes.parse_override(s)[0])]
    if named:
        raise UserError(
            f"--set {named[0]}: the model comes from --from {source} as it was saved (its shape and settings); "
            f"model.* sets a model built from a recipe, without --from"
        )


def named_code(shortcuts: dict, sets: list[str]) -> frozenset[str]:
    """The user's own functions (file.py:function, absolute) that this command line names, in its flags
    or its --set values: the only code tfcli may import (a GRPO reward). A run, a recipe or a grid file
    that names one is data: its reward is refused until the command line names it too."""
    from ..tasks.rewards import user_functions

    values = [v for v in shortcuts.values() if isinstance(v, str)] + [
        v for _, v in map(recipes.parse_override, sets) if isinstance(v, str)
    ]
    return user_functions(*values)


def note(text: str) -> None:
    typer.echo(f"note: {text}", err=True)


def newest(checkpoint: Path | None, families: tuple[str, ...] = ()) -> Path:
    """--checkpoint, or the newest run under runs/ (of `families` when given), named so that nobody
    wonders which it was."""
    if checkpoint is not None:
        return checkpoint
    from ..engine.checkpoint import newest_run

    run = newest_run(families=families)
    note(f"using the newest run{' that can generate' if families else ''}: {run}")
    return run


def check_device(device: str | None) -> None:
    import torch

    if device and device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {device}: no CUDA device is available here (use cpu)")


def run_training(
    rec: recipes.Recipe,
    source: ModelSource | None,
    out: Path | None,
    resume: Path | None,
    quiet: bool,
    dry_run: bool = False,
    code: frozenset[str] = frozenset(),
    vision: ModelSource | None = None,
):
    """Train the run (returns nothing), or with dry_run print its memory plan and return it. `code`: the
    user functions the command line names (named_code)."""
    from ..display import console
    from ..driver import RunRequest, train
    from ..driver import dry_run as plan_only

    request = RunRequest(rec, source, out, resume, quiet, dry_run, code, vision)
    if dry_run:
        return plan_only(request)
    run_dir, hints = train(request)
    if int(os.environ.get("RANK", "0")) == 0:  # once under torchrun
        console.print(f"\n[bold green]done.[/] run: {run_dir}\n" + "\n".join(hints))
