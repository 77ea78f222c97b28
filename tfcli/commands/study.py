"""compare and probe: which way of using a pretrained model works best on the user's own data."""

from __future__ import annotations

from pathlib import Path

import typer

from ..errors import UserError
from .common import QUIET, overrides, recipes, user_errors


@user_errors
def compare(
    task: str | None = typer.Option(
        None, help="Task(s), comma-separated: mnli, classify, image-classify, sft, gsm8k, dpo."
    ),
    from_: str | None = typer.Option(
        None, "--from", help="The models, comma-separated: tfcli runs, Hugging Face directories or hub ids."
    ),
    train: str | None = typer.Option(
        None,
        help="The approaches, comma-separated: a finetuning method (all, head, lora, qlora, ia3, bitfit, projector); X+head (a classifier head, e.g. lora+head), X:POOLING (head:mean), Kshot (prompting, nothing trained: 0shot,4shot) [default: all].",
    ),
    budget: str | None = typer.Option(
        None,
        help="Each cell's budget: 500steps, 10000ex (one epoch over N rows), 10m / 1h (training time) or 1epoch [default: 1epoch].",
    ),
    data: str | None = typer.Option(None, help="Task data for every cell [default: each recipe's]."),
    lr: str | None = typer.Option(
        None, help="Learning rate per approach, e.g. all=5e-5,lora=5e-4 [default: the recipe's]."
    ),
    grid: Path | None = typer.Option(
        None, help="A YAML file with tasks, from, train, budget, data, lr and set; flags win."
    ),
    out: Path = typer.Option(..., help="The study's directory: cells/, logs/, results.md, results.csv, results.png."),
    set_: list[str] = typer.Option([], "--set", help="key.path=value for every cell (repeatable)."),
    vary: list[str] = typer.Option(
        [],
        "--vary",
        help="key.path=v1,v2: run every training cell at each value, e.g. --vary dpo.beta=0.1,0.3 (repeatable: all combinations).",
    ),
    report_limit: int | None = typer.Option(
        None,
        help="Score every cell on the same balanced sample of N examples of each evaluation split [default: all of them].",
    ),
    quiet: bool = QUIET,
):
    """Finetune (or prompt) every model in every approach to the same budget and tabulate the results."""
    # torch first, from no half-imported module: its import walks sys.modules and so loads the lazy
    # tfcli.recipe, which imports tfcli.adapters (compare's first import)
    import torch  # noqa: F401

    from ..display import configure, console
    from . import compare as study

    configure(not quiet)
    spec = study.load_grid(grid, task, from_, train, budget, data, lr, set_, report_limit, vary)
    if not quiet:
        varied = "".join(f" x {len(v)} {k}" for k, v in spec.vary.items())
        console.print(
            f"{len(spec.cells())} cells ({len(spec.tasks)} task(s) x {len(spec.backbones)} model(s) x "
            f"{len(spec.approaches)} approaches{varied}), {spec.budget} each, in {out}"
        )
    rows = study.run_grid(spec, out, quiet)
    md, csv_path = study.write_tables(rows, out)
    picture = study.chart(rows, out)
    if not quiet:
        study.show(rows)
        console.print(f"wrote {md}, {csv_path}" + (f" and {picture}" if picture else ""))
    failed = [r for r in rows if r.get("status") != "done"]
    if failed:
        raise UserError(
            f"{len(failed)} of {len(rows)} cells did not finish (see {out}/logs); run the same command again to retry them"
        )


@user_errors
def probe(
    ctx: typer.Context,
    task: str = typer.Argument(
        ..., help="What to probe for: a preset (mnli), classify (your labelled text) or image-classify."
    ),
    from_: str = typer.Option(
        ...,
        "--from",
        help="The model(s), comma-separated: tfcli runs, Hugging Face directories or hub ids, GGUF files.",
    ),
    data: str | None = typer.Option(None, help="The task's data, as finetune reads it [default: the recipe's]."),
    layers: str = typer.Option("all", help="all, or depths such as 0,3,6 (0: the embeddings, n: the n-th block)."),
    pooling: str = typer.Option(
        "mean", help="mean (of tokens or patches), last (a decoder's last token) or cls (an encoder's first)."
    ),
    method: str = typer.Option(
        "ridge", help="ridge (closed form, its penalty picked on a fifth of the training set) or logistic (L-BFGS)."
    ),
    limit: int = typer.Option(2000, help="Training examples for the probes: a seeded, class-balanced sample (0: all)."),
    eval_limit: int = typer.Option(1000, help="Examples of each evaluation split (0: all)."),
    out: Path = typer.Option(Path("probe"), help="Directory for probe.json and probe.png."),
    seed: int = typer.Option(0, help="Seed of the samples."),
    set_: list[str] = typer.Option(
        [], "--set", help="A recipe field for reading the data, e.g. --set classify.text_fields=[title] (repeatable)."
    ),
):
    """A linear probe on every layer: how much of a task each depth of a model holds (features cached)."""
    from .probe import ProbeRequest, run

    sets = dict(recipes.parse_override(x) for x in overrides(set_, ctx.args))
    sources = [str(resolve_hub(x)) for x in from_.split(",") if x.strip()]
    run(ProbeRequest(task, sources, data, layers, pooling, method, limit, eval_limit, sets, out, seed))


def resolve_hub(source: str) -> Path:
    from ..engine import model_source

    return model_source.resolve(source.strip()).path
