"""The one run driver. Pretraining and every finetuning task go through `train`:

    runtime -> plug-in -> backbone (fresh, a tfcli run, a Hugging Face directory, or the run being
    resumed) -> the recipe resolved against it -> plug-in setup (Job) -> schedule from epochs ->
    run directory -> fit -> plug-in report

and every evaluation through `evaluate`. The recipe is resolved here, once, and never mutated:
each derived value (the backbone's model shape, the tokenizer's vocabulary, steps from epochs,
warmup from its fraction) makes a new frozen Recipe, which is what the run saves.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from . import backbone as backbones
from . import checkpoint, registry
from . import recipe as recipes
from .display import console
from .errors import UserError
from .plugin import Backbone, EvalOptions, Job, Plugin
from .recipe import Recipe
from .runtime import Runtime, setup_runtime, teardown
from .train import ObjectiveModule, fit


@dataclass
class RunRequest:
    """What a training command asks for."""

    recipe: Recipe
    source: Optional[str] = None  # --from: a tfcli run or a Hugging Face directory
    out: Optional[Path] = None
    resume: Optional[Path] = None  # a run directory to continue
    quiet: bool = False


def make_plugin(kind: str, key: str, rt: Runtime, quiet: bool = False) -> Plugin:
    return registry.plugin_class(kind, key)(rt, quiet)


def train(req: RunRequest) -> tuple[Path, Plugin]:
    """Run a training job end to end; return its run directory and plug-in (for its hints)."""
    t = req.recipe.train
    rt = setup_runtime(t.device, t.threads, t.strategy)
    try:
        plugin = make_plugin(req.recipe.kind, req.recipe.plugin, rt, req.quiet)
        ckpt = checkpoint.find(req.resume) if req.resume else None
        backbone = backbones.for_resume(req.resume, req.recipe) if req.resume else \
            backbones.load(req.source, req.recipe, plugin, rt)
        recipe = plugin.resolve(req.recipe, backbone)
        with rt.main_first():  # rank 0 fills the tokenization caches first
            job = plugin.setup(recipe, backbone)
        recipe = resolve_schedule(recipe, job, rt)
        run_dir = open_run_dir(recipe, req, rt, backbone, job)
        if rt.is_main and not req.quiet:
            console.print(banner(recipe, plugin, backbone, run_dir, ckpt))
        module = ObjectiveModule(backbone.model, job.heads, job.loss)
        fit(module, job, recipe, run_dir, rt, resume_from=ckpt, quiet=req.quiet)
    finally:
        teardown(rt)
    if rt.is_main:
        plugin.report(recipe, run_dir)
    return run_dir, plugin


def resolve_schedule(recipe: Recipe, job: Job, rt: Runtime) -> Recipe:
    """A task's steps from finetune.epochs and its warmup from finetune.warmup_fraction."""
    ft, t = recipe.finetune, recipe.train
    if ft is None:
        return recipe
    if ft.epochs > 0:
        per_step = t.batch_size * t.grad_accum * rt.world_size
        recipe = recipes.replace(recipe, train=recipes.replace(t, steps=max(1, math.ceil(ft.epochs * job.examples / per_step))))
    if ft.warmup_fraction > 0:
        warmup = max(1, round(ft.warmup_fraction * recipe.train.steps))
        recipe = recipes.replace(recipe, schedule=recipes.replace(recipe.schedule, warmup_steps=warmup))
    if recipe.train.steps <= 0:
        raise UserError("train.steps is 0: give --steps, or finetune.epochs for a task")
    return recipe


def open_run_dir(recipe: Recipe, req: RunRequest, rt: Runtime, backbone: Backbone, job: Job) -> Path:
    """Create the run directory (or reuse the one being resumed) and write the resolved recipe, the
    tokenizer and the plug-in's files into it. Rank 0 writes; every rank gets the same path. Called
    only once data, tokenizer and model are known to be good, so bad input leaves no directory."""
    run_dir = Path(req.resume) if req.resume else Path(rt.broadcast(str(new_run_dir(recipe, req.out))))
    if rt.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        recipes.save(recipe, run_dir / "config.yaml")
        if backbone.tokenizer is not None:
            backbone.tokenizer.save(run_dir)
        for name, data in job_files(job).items():
            (run_dir / name).write_text(data)
    rt.barrier()
    return run_dir


def job_files(job: Job) -> dict[str, str]:
    """Files a plug-in keeps beside its checkpoints: a classifier's class names."""
    return {backbones.LABELS_FILE: json.dumps(list(job.labels))} if job.labels else {}


def new_run_dir(recipe: Recipe, out: Optional[Path]) -> Path:
    if out is None:
        return Path("runs") / f"{recipe.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file; give a directory for the run")
    if (out / checkpoint.CHECKPOINTS).exists():
        raise UserError(f"{out} already holds a run; use --resume {out} or another --out")
    return out


def banner(recipe: Recipe, plugin: Plugin, backbone: Backbone, run_dir: Path, ckpt: Optional[Path]) -> str:
    n = sum(p.numel() for p in backbone.model.parameters())
    source = "" if backbone.source in ("scratch", str(run_dir)) else f" from {backbone.source}"
    return (f"[bold]{recipe.name}[/]: {plugin.title(recipe, backbone)} on a {n / 1e6:.2f}M-parameter {backbone.family}{source}, "
            f"{recipe.train.steps:,} steps, run directory [green]{run_dir}[/]"
            + (f" (resuming from {ckpt.name})" if ckpt else ""))


# --- evaluation ---------------------------------------------------------------------------------

def evaluate(path: Path, key: Optional[str], settings: dict[str, Any], options: EvalOptions) -> dict[str, Any]:
    """`tfcli eval [KEY] --checkpoint RUN`: the run's own plug-in's evaluation, or plug-in KEY's
    (e.g. k-shot MNLI of a pretrained GPT); `settings` override the plug-in's recipe section."""
    backbone = backbones.from_run(Path(path), which="best")
    recipe = backbone.recipe
    key = key or recipe.plugin
    kind = "objective" if key in registry.OBJECTIVES else "task"
    recipe = as_plugin(recipe, kind, key, settings)
    plugin = make_plugin(kind, key, setup_runtime("cpu"))
    if backbone.family not in plugin.families:
        raise UserError(f"{backbone.checkpoint} holds a {backbone.family!r} model; `eval {key}` needs "
                        f"{' or '.join(plugin.families)}")
    return plugin.evaluate(recipe, backbone, options)


def as_plugin(recipe: Recipe, kind: str, key: str, settings: dict[str, Any]) -> Recipe:
    """The run's recipe, seen by plug-in `key` with `settings` over its section (its own when it is
    the run's plug-in; defaults otherwise)."""
    raw = recipes.to_dict(recipe)
    if key != recipe.plugin:
        for k in (recipe.kind, recipe.plugin, "finetune"):
            raw.pop(k, None)
        raw[kind] = key
    raw[key] = {**(raw.get(key) or {}), **settings}
    if not raw[key]:
        raw.pop(key)
    return recipes.from_dict(raw)
