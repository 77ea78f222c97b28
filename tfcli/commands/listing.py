"""runs, plot, upgrade and recipes: what is on disk, drawn or listed."""

from __future__ import annotations

from pathlib import Path

import typer

from .common import recipes, user_errors


@user_errors
def runs(root: Path = typer.Argument(Path("runs"), help="The directory holding the runs.")):
    """List the runs: name, family, objective or task, steps done, best metric, when."""
    from rich.table import Column, Table

    from ..display import console
    from .runs import age, list_runs

    table = Table(Column("run", no_wrap=True), "family", "objective / task", "steps", "best", "when")
    for info in list_runs(root):
        table.add_row(
            info.path.name, info.family, info.what, f"{info.step:,}/{info.steps:,}", info.best, age(info.when)
        )
    console.print(table)


@user_errors
def plot(
    run: list[Path] = typer.Argument(..., help="One or more run directories."),
    out: Path = typer.Option(Path("runs.png"), help="Where to write the PNG."),
    metric: str = typer.Option(
        "loss",
        help="The metric to draw (loss, mlm_loss, val_dev_matched_acc, val_piqa_acc_norm: val_ names a held-out one).",
    ),
    split: str = typer.Option("val", help="val | train: which rows to draw (train when a run has no val rows)."),
):
    """Overlay the runs' loss curves (or another metric) in one PNG."""
    from ..display import console
    from ..engine.plots import compare_runs, run_curves

    path = run_curves(run[0], out, metric) if len(run) == 1 else compare_runs(run, out, metric, split)
    console.print(f"wrote {path}")


@user_errors
def upgrade(
    run: Path = typer.Argument(..., help="A run directory whose checkpoints hold state.pt (tfcli before 0.2)."),
):
    """Convert a run's pickled training state (state.pt) to state.safetensors + state.json, reading it
    with torch's weights_only loader: a pickle that carries code is refused, not run."""
    from ..display import console
    from ..engine.checkpoint import upgrade_legacy

    done = upgrade_legacy(run)
    console.print(f"converted {len(done)} checkpoint(s) of {run}" if done else f"{run}: nothing to convert")


def recipes_list(ctx: typer.Context):
    """List the shipped recipes."""
    if ctx.invoked_subcommand is not None:
        return
    from rich.table import Column, Table

    from ..display import console

    table = Table(Column("recipe", no_wrap=True), "objective / task", "model", "steps", "batch", "lr")
    for name in recipes.available():
        raw = recipes.load_raw(name)
        m, t, o = raw.get("model", {}), raw.get("train", {}), raw.get("optim", {})
        shape = f"{m.get('family', '?')} L{m.get('n_layer', '?')} d{m.get('d_model', '?')}"
        plugin = raw.get("objective") or raw.get("task", "")
        preset = (raw.get(plugin) or {}).get("preset") if isinstance(raw.get(plugin), dict) else None
        table.add_row(
            name,
            f"{plugin} ({preset})" if preset else str(plugin),
            shape,
            str(t.get("steps", "")),
            str(t.get("batch_size", "")),
            str(o.get("lr", "")),
        )
    console.print(table)


@user_errors
def recipes_show(name: str = typer.Argument(..., help="Recipe name or path.")):
    """Print a recipe fully resolved, every default filled in."""
    import yaml

    typer.echo(yaml.safe_dump(recipes.to_dict(recipes.load(name)), sort_keys=False), nl=False)


@user_errors
def models():
    """List the model families tfcli builds natively: the Hugging Face architectures each reads and
    writes, what it pretrains with, the tasks that train it, GGUF in and out."""
    import torch  # noqa: F401  (loaded before tfcli's own modules: see commands/common.py's lazy recipe module)
    from rich.table import Column, Table

    from .. import adapters
    from .. import registry as plugin_registry
    from ..display import console
    from ..hf import registry
    from ..models import FAMILIES, kind_of

    def plugins(kind: str, family: str) -> str:
        """The tasks that train a family's model (given with --from); the objectives with a recipe for it
        (pretraining builds the model from a recipe)."""
        classes = {k: plugin_registry.plugin_class(kind, k) for k in plugin_registry.known(kind)}
        takes = {k: c.recipes if kind == "objective" else c.families for k, c in classes.items()}
        return ", ".join(k for k, of in takes.items() if family in of) or "-"

    table = Table(Column("family", no_wrap=True), "kind", "Hugging Face model_type (in and out)", "pretrain", "tasks")
    for family in FAMILIES:
        types = [r.model_type + (" +gguf" if r.gguf else "") for r in registry.of_family(family)]
        read = types or ["any other transformers ships"]
        table.add_row(family, kind_of(family), ", ".join(read), plugins("objective", family), plugins("task", family))
    console.print(table)
    console.print(
        f"Every task trains with --train {' | '.join(adapters.METHODS)} where its kind allows. +gguf: "
        "GGUF files read and written (llama.cpp's architecture of that name). generic, "
        "generic-encoder: any other architecture transformers ships, through its own modules "
        "(pip install 'tfcli\\[transformers]'); a native family is always preferred."
    )
