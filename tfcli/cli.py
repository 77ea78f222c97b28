"""The `tfcli` command: the typer app, its subcommands (tfcli.commands, by group) and the entry point.

One vocabulary of flags wherever a model runs: --seed, --device, --precision, --quiet; `--set
key=value` or a bare `key=value` overrides any recipe field (tfcli.commands.common). Heavy modules
(torch, the driver) are imported by the commands that need them, so that --help and shell completion
answer at once.
"""

from __future__ import annotations

import os
import sys

import typer
from typer._click import exceptions as click_errors  # typer vendors click

from . import __version__
from .commands import listing, sampling, study, trained, training
from .commands.common import TRAINING

app = typer.Typer(
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    help="Pretrain, finetune, evaluate and sample transformers.",
)
recipes_app = typer.Typer(add_completion=False, rich_markup_mode=None, help="List or show recipes.")
app.add_typer(recipes_app, name="recipes")

app.command(context_settings=TRAINING)(training.pretrain)
app.command()(training.prepare)
app.command(context_settings=TRAINING)(training.finetune)
app.command("eval")(trained.eval_)
app.command()(trained.export)
app.command()(sampling.generate)
app.command("chat")(sampling.chat_command)
app.command()(study.compare)
app.command(context_settings=TRAINING)(study.probe)
app.command()(listing.runs)
app.command()(listing.plot)
app.command()(listing.upgrade)
app.command()(listing.models)
recipes_app.callback(invoke_without_command=True)(listing.recipes_list)
recipes_app.command("show")(listing.recipes_show)


def _version(value: bool) -> None:
    if value:
        import torch

        typer.echo(f"tfcli {__version__} (torch {torch.__version__}, Python {sys.version.split()[0]})")
        raise typer.Exit()


@app.callback()
def _options(
    version: bool | None = typer.Option(
        None, "--version", callback=_version, is_eager=True, help="Print tfcli's version and exit."
    ),
):
    """Pretrain, finetune, evaluate and sample transformers."""


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
