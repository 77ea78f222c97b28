"""The one run driver. Pretraining and every finetuning task go through `train`:

    runtime -> plug-in -> backbone (fresh, a tfcli run, a Hugging Face directory, or the run being
    resumed) -> the recipe resolved against it -> plug-in setup (Job) -> schedule from epochs ->
    run directory -> fit -> plug-in report

and every evaluation through `evaluate`. The recipe is resolved here, once, and never mutated:
each derived value (the backbone's model shape, the tokenizer's vocabulary, steps from epochs,
warmup from its fraction) makes a new frozen Recipe, which is what the run saves.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from . import adapters, display, registry
from . import recipe as recipes
from .bench import in_training
from .display import console
from .engine import backbone as backbones
from .engine import checkpoint, memory, model_source
from .engine.compose import compose
from .engine.model_source import ModelSource
from .engine.perf import peak_memory_mb
from .engine.runtime import Runtime, resolve_precision, setup_runtime, teardown
from .engine.trainer import ObjectiveModule, Trainer
from .errors import UserError
from .models import kind_of, kinds, model_class
from .models.nf4 import NF4Linear
from .plugin import Backbone, EvalOptions, Job, Plugin
from .recipe import AdapterConfig, Recipe


@dataclass
class RunRequest:
    """What a training command asks for."""

    recipe: Recipe
    source: ModelSource | None = None  # --from, resolved (engine.model_source.resolve)
    out: Path | None = None
    resume: Path | None = None  # a run directory to continue
    quiet: bool = False
    dry_run: bool = False  # print the memory plan and stop: nothing trained or written
    named_code: frozenset[str] = frozenset()  # file.py:function the command line names (plugin.EvalOptions)
    vision_from: ModelSource | None = (
        None  # --vision-from: a vision tower composed with --from's decoder (engine/compose.py)
    )


def make_plugin(kind: str, key: str, rt: Runtime, quiet: bool = False, named_code: frozenset = frozenset()) -> Plugin:
    return registry.plugin_class(kind, key)(rt, quiet, named_code)


def train(req: RunRequest) -> tuple[Path, list[str]]:
    """Run a training job end to end; return its run directory and what to run next. Every
    input is checked (recipe, data, backbone, the checkpoint being resumed) before the run directory
    is created or touched."""
    rt = started(req)
    try:
        plugin = checked_plugin(req, rt)
        benchmarks = benchmarks_of(req.recipe)
        run_dir = Path(req.resume) if req.resume else Path(rt.broadcast(str(new_run_dir(req.recipe, req.out))))
        ckpt = resume_point(req.resume)
        # everything random that is built from here (a fresh model, adapters, a task's heads) is built the
        # same way in every run of the same recipe: a process's initial seed differs from run to run
        torch.manual_seed(req.recipe.train.seed)
        source, backbone = starting_model(req, plugin, rt, ckpt)
        recipe = plugin.resolve(req.recipe, backbone)
        plugin.run_dir = run_dir
        with rt.main_first():  # rank 0 fills the tokenization caches first
            job = plugin.setup(recipe, backbone)
        if not job.held_out and rt.is_main and not req.quiet:
            console.print(f"[yellow]note:[/] {nothing_held_out(plugin)}")
        job = with_benchmarks(job, recipe, backbone, rt, benchmarks)
        if source is not None and ckpt is None and plugin.kind == "objective":
            carry_heads(job, backbone, rt.is_main and not req.quiet)
        recipe = resolve_schedule(recipe, job, rt)
        if ckpt is not None:
            recipe = keep_global_batch(recipe, ckpt, rt)
        recipe, plan, note = fit_memory(recipe, job, backbone.model, rt, measured_so_far(rt), resumed=ckpt)
        module = trained_module(recipe, job, backbone.model, rt)
        partial = saves_partial(recipe, source) and vision_source(req) is None  # a composed model has no one base
        trainer = Trainer(module, job, recipe, run_dir, rt, req.quiet, partial=partial)
        if ckpt is not None:
            trainer.restore(ckpt)  # refuses a checkpoint that does not fit, before anything is written
        created = req.resume is None and not run_dir.exists()  # not an empty --out the user made
        with run_lock(run_dir, rt), removed_on_failure(run_dir, rt, created):
            counts = parameter_counts(module)
            write_run_files(recipe, run_dir, rt, backbone, job, source, counts, plan, vision_source(req))
            trainer.forget_after(trainer.step)
            if rt.is_main and not req.quiet:
                console.print(banner(recipe, plugin, module, backbone, run_dir, ckpt, rt))
                console.print(plan.summary(), highlight=False)
                if note:
                    console.print(f"[yellow]note:[/] {note}")
            trainer.fit()
            if rt.is_main and not req.quiet:
                console.print(peak_line(plan, rt), highlight=False)
    finally:
        teardown(rt)
    if rt.is_main and job.held_out:
        plugin.report(recipe, run_dir)
    return run_dir, plugin.next_commands(run_dir, job.held_out)


def nothing_held_out(plugin: Plugin) -> str:
    return (
        f"{plugin.key}: no held-out examples (each held-out row was skipped); training without held-out "
        f"evaluation, best checkpoint or final report (give a dev split with usable rows, or a larger "
        f"data.val_fraction)"
    )


def started(req: RunRequest) -> Runtime:
    """The run's runtime, the display set for it, and the recipe's precision resolved on its device."""
    rt = runtime_for(req)
    if rt.device.type == "cpu":  # before anything is read: reading a model leaves the heap it grew
        memory.follow_the_plan(limited=False)
    display.configure(rt.is_main and not req.quiet)
    req.recipe = recipe_with(req.recipe, "train", precision=resolve_precision(req.recipe.train.precision, rt.device))
    return rt


def checked_plugin(req: RunRequest, rt: Runtime) -> Plugin:
    plugin = make_plugin(req.recipe.kind, req.recipe.plugin, rt, req.quiet, req.named_code)
    check_streaming(req.recipe, plugin)
    return plugin


def dry_run(req: RunRequest) -> memory.Plan:
    """--dry-run: the run's memory plan, from its model's shapes (on the meta device, no weight read)
    and one batch of its data at the recipe's lengths, printed; nothing is trained or written."""
    rt = started(req)
    try:
        plugin = checked_plugin(req, rt)
        benchmarks = benchmarks_of(req.recipe)
        if req.out is not None and not req.resume:
            new_run_dir(req.recipe, req.out)  # --out is checked as a run would (nothing is created)
        ckpt = resume_point(req.resume)
        torch.manual_seed(req.recipe.train.seed)
        source, backbone = starting_model(req, plugin, rt, ckpt, shapes_only=True)
        recipe = plugin.resolve(req.recipe, backbone)
        job = with_benchmarks(plugin.setup(recipe, backbone), recipe, backbone, rt, benchmarks)
        recipe = resolve_schedule(recipe, job, rt)
        copies = reading_copies(source, ckpt)
        recipe, plan, note = fit_memory(recipe, job, backbone.model, rt, copies, resumed=ckpt, dry_run=True)
    finally:
        teardown(rt)
    if rt.is_main:
        model = (
            f"{source.path.name} (recipe {recipe.name})"
            if source
            else f"a new {recipe.model.family} (recipe {recipe.name})"
        )
        display.plan_table(plan, f"memory plan of {model}, {recipe.train.steps:,} steps: nothing trained")
        if note:
            console.print(f"[yellow]note:[/] {note}")
    return plan


def reading_copies(source: ModelSource | None, ckpt: Path | None) -> float:
    """How many copies of its fp32 weights a run holds while reading them (a dry run's estimate)."""
    if ckpt is not None:
        return memory.READ_COPIES["other"]
    if source is None:
        return 0.0  # a fresh model is not read from a file
    return memory.READ_COPIES["gguf" if source.is_gguf else "other"]


def fit_memory(
    recipe: Recipe,
    job: Job,
    model: nn.Module,
    rt: Runtime,
    reading: float,
    resumed: Path | None = None,
    dry_run: bool = False,
) -> tuple[Recipe, memory.Plan, str]:
    """The run's memory plan, and the recipe with what it chose: train.activation_checkpointing auto
    resolved, and micro-batches when train.memory_limit needs them (a one-line error when nothing fits,
    before the run directory exists). A resumed run (`resumed`: its checkpoint) keeps what it chose when
    it started, and its plan counts reading that checkpoint."""
    t = recipe.train
    if rt.device.type == "cpu" and not dry_run:  # before the probes: training's setting, a limit's or glibc's ceiling
        quantized = recipe.finetune is not None and adapters.method(recipe.finetune.train).quantized
        memory.follow_the_plan(limited=bool(memory.parse_limit(t.memory_limit)) or quantized)
    restoring = checkpoint.tensor_file_bytes(resumed) if resumed is not None else 0.0
    plans, capacity = memory.planner(recipe, job, model, rt, reading, dry_run, restoring)
    limit = 0.0 if resumed else memory.limit_of(t.memory_limit, capacity)
    plan, note = memory.choose(plans, t.batch_size, t.activation_checkpointing, t.micro_batch_size, limit)
    memory.returned_to_os()  # what the probes freed, back to the system before training takes its own
    micro = plan.micro_batch if plan.micro_batch != t.batch_size else t.micro_batch_size
    recipe = recipe_with(
        recipe,
        "train",
        activation_checkpointing="blocks" if plan.checkpointing else "none",
        micro_batch_size=micro,
    )
    return recipe, plan, note


def measured_so_far(rt: Runtime) -> float:
    """The process's peak so far on the CPU (reading the weights, tokenizing), in bytes."""
    return peak_memory_mb(rt.device) * 2**20 if rt.device.type == "cpu" else 0.0


def peak_line(plan: memory.Plan, rt: Runtime) -> str:
    """The final report's memory line: the measured peak beside the plan's."""
    measured = peak_memory_mb(rt.device) * 2**20
    what = "resident" if rt.device.type == "cpu" else "allocated"
    return (
        f"peak memory: {memory.gb(measured)} {what} (planned {memory.gb(plan.peak)}, "
        f"{100 * (plan.peak - measured) / max(measured, 1):+.0f}%)"
    )


def benchmarks_of(recipe: Recipe) -> list[in_training.Read]:
    """train.eval_tasks' questions, read and checked before any model is read."""
    t = recipe.train
    return in_training.read(t.eval_tasks, t.eval_tasks_data, t.eval_tasks_few_shot)


def with_benchmarks(job: Job, recipe: Recipe, backbone: Backbone, rt: Runtime, read: list) -> Job:
    """train.eval_tasks scored at every evaluation and train.select_by picking the best checkpoint;
    both checked here, before the run directory exists."""
    planned = in_training.plan(read, backbone.model, backbone.tokenizer)
    pad = type(backbone.model).pad_id(backbone.tokenizer) if planned else 0
    job = in_training.add_to(job, planned, pad, recipe.train.precision, rt.device)
    return in_training.select_by(job, recipe.train.select_by, in_training.metric_names(planned))


def check_streaming(recipe: Recipe, plugin: Plugin) -> None:
    if recipe.data.streaming and not plugin.streaming:
        raise UserError(
            f"data.streaming: {plugin.kind} {plugin.key!r} reads its data whole; streaming is for "
            f"clm and span (for a large corpus, tfcli prepare it once and train on the store)"
        )


def starting_model(
    req: RunRequest, plugin: Plugin, rt: Runtime, ckpt: Path | None, shapes_only: bool = False
) -> tuple[ModelSource | None, Backbone]:
    """(where the weights come from, the backbone): --from (a hub id resolved), or the resumed run's
    own record of it; the backbone read from there, or from the checkpoint being resumed (shapes_only:
    on the meta device, for a memory plan)."""
    recorded = backbones.recorded(req.resume).get("from") if req.resume else None
    if ckpt:
        assert req.resume is not None  # a checkpoint is only read for a resumed run
        source = model_source.recorded(recorded)  # a base that moved: the checkpoint says what it needs
        return source, backbones.for_resume(req.resume, req.recipe, ckpt, shapes_only)
    source = req.source or (model_source.resolve(recorded) if recorded else None)
    req = replace(req, vision_from=vision_source(req))
    if req.recipe.finetune is not None:
        adapters.check_base(req.recipe.finetune.train, pretrained=source is not None)
    if source is None and kinds.reads_images(model_class(req.recipe.model.family)):
        raise UserError(
            "a vision-language model is built from pretrained parts: give --from (a LLaVA or SmolVLM directory, or "
            "a run of one), or --from DECODER --vision-from VIT_RUN"
        )
    refuse_what_cannot_fit(source, req.recipe, plugin, rt)  # a dry run too: the same refusal, at the same point
    if req.vision_from is not None:
        if source is None:
            raise UserError("--vision-from joins a vision tower to a decoder: give the decoder with --from")
        decoder = backbones.load(source, req.recipe, plugin, rt)
        return source, compose(decoder, req.vision_from, req.recipe.model, req.recipe.train.seed)
    return source, backbones.load(source, req.recipe, plugin, rt, shapes_only)


def vision_source(req: RunRequest) -> ModelSource | None:
    """The vision tower a composed model was joined from: --vision-from, or a resumed run's record of it."""
    recorded = backbones.recorded(req.resume).get("vision_from") if req.resume else None
    return req.vision_from or (model_source.resolve(recorded, "--vision-from") if recorded else None)


def refuse_what_cannot_fit(source: ModelSource | None, recipe: Recipe, plugin: Plugin, rt: Runtime) -> None:
    """Before the weights or the data are read: a run whose weights, frozen reference copy, gradients
    and optimizer states alone pass train.memory_limit stops in one line (a model too large for the
    machine is refused, not killed while it is read; the full plan, which needs a batch of the data,
    comes later)."""
    limit = memory.limit_of(recipe.train.memory_limit, memory.process_capacity(rt))
    if limit <= 0:
        return
    floor = memory.floor_figures(backbones.meta_model(source, recipe, plugin), recipe, plugin.frozen_copies(recipe))
    memory.refuse_beyond(memory.per_process(floor, rt.strategy, rt.world_size), limit, recipe)


def trained_module(recipe: Recipe, job: Job, model, rt: Runtime) -> ObjectiveModule:
    """The model (with what finetune.train trains: adapters.apply) and the Job's heads behind one
    forward; what the loss never reads (Job.unread) is frozen. On the CPU each block gives the heap's
    free pages back as it trains (memory.trim_after_each_block: the peak stays at the plan's)."""
    if recipe.finetune is not None:
        ft = recipe.finetune
        adapters.apply(model, ft.train, recipe.adapter or AdapterConfig(), ft.freeze_router, ft.train_vision)
    for p in job.unread:
        p.requires_grad_(False)
    if rt.device.type == "cpu" and recipe.train.compile != "on":  # a compiled graph would break at each hook
        memory.trim_after_each_block(model)
    return ObjectiveModule(model, job.heads, job.loss)


def carry_heads(job: Job, backbone: Backbone, say: bool) -> None:
    """Continued pretraining: the objective's heads take the weights the source has for them (a tfcli
    run of the same objective, transformers' BertForPreTraining); the others keep their fresh
    initialisation, named in one line (all-MiniLM has no masked-LM head)."""
    own = job.heads.state_dict()
    found = {k: v for k, v in backbone.heads.items() if k in own and v.shape == own[k].shape}
    job.heads.load_state_dict({**own, **found})
    fresh = sorted({k.split(".", 1)[0] for k in own if k not in found})  # heads by name: mlm, nsp, ...
    if say and fresh:
        console.print(
            f"[yellow]note:[/] {backbone.source} has no weights for the objective's "
            f"{' and '.join(fresh)} head{'s' if len(fresh) > 1 else ''}; initialised as a new run's"
        )


def runtime_for(req: RunRequest) -> Runtime:
    """The run's runtime; a resumed run keeps the CPU threads it trained with (unless train.threads)."""
    t = req.recipe.train
    resumed = 0 if t.threads else resumed_threads(req.resume)
    rt = setup_runtime(t.device, t.threads or resumed, t.strategy, t.collective_timeout, t.deterministic)
    if resumed:
        rt.threads_why = "as the run trained with"
    return rt


def resumed_threads(run: Path | None) -> int:
    """The CPU threads a resumed run trained with (0: choose anew): the same count gives the same
    floating-point sums, so the run continues bit for bit whatever else the machine now runs."""
    if (
        run is None
        or int(os.environ.get("WORLD_SIZE", "1")) > 1
        or not (Path(run) / checkpoint.CHECKPOINTS / "latest").is_file()
    ):
        return 0
    return int(checkpoint.read_meta(checkpoint.find(run)).get("threads", 0))


def keep_global_batch(recipe: Recipe, ckpt: Path, rt: Runtime) -> Recipe:
    """A run resumed on another number of processes keeps its global batch (batch_size x grad_accum x
    processes) by changing grad_accum when it can, so the same data order gives the same steps."""
    meta = checkpoint.read_meta(ckpt)
    before, processes, t = meta.get("global_batch"), meta.get("processes"), recipe.train
    now = t.batch_size * t.grad_accum * rt.world_size
    if before is None or processes == rt.world_size or before == now:
        return recipe
    per_step = t.batch_size * rt.world_size
    if before % per_step == 0:
        accum = before // per_step
        if rt.is_main:
            console.print(
                f"[yellow]note:[/] resuming on {rt.world_size} process(es) (was {processes}): "
                f"train.grad_accum {t.grad_accum} -> {accum} keeps the global batch of {before}"
            )
        return recipe_with(recipe, "train", grad_accum=accum)
    if rt.is_main:
        console.print(
            f"[yellow]note:[/] resuming on {rt.world_size} process(es) (was {processes}): the global batch "
            f"changes from {before} to {now} (not a multiple of batch_size x processes); the data order continues"
        )
    return recipe


def recipe_with(recipe: Recipe, section: str, **values) -> Recipe:
    return recipes.replace(recipe, **{section: recipes.replace(getattr(recipe, section), **values)})


def saves_partial(recipe: Recipe, source: ModelSource | None) -> bool:
    """A finetuning run that trains part of a model it read from somewhere saves only that part (and
    the heads); loading it reads the base again (small checkpoints, as PEFT's)."""
    return recipe.finetune is not None and not adapters.method(recipe.finetune.train).whole and bool(source)


def resume_point(run: Path | None) -> Path | None:
    """The checkpoint to resume from; None for a new run, or for a run stopped before its first
    checkpoint (it starts again from step 0 in the same directory)."""
    if run is None:
        return None
    if not (Path(run) / checkpoint.CHECKPOINTS / "latest").is_file():
        console.print(f"[yellow]note:[/] {run} has no checkpoint yet; starting it again from step 0")
        return None
    return checkpoint.find(run)


@contextlib.contextmanager
def run_lock(run_dir: Path, rt: Runtime):
    """Rank 0 creates the run directory and holds its lock while the run writes into it."""
    if not rt.is_main:
        rt.barrier()
        yield
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    with checkpoint.lock(run_dir):
        rt.barrier()
        yield


@contextlib.contextmanager
def removed_on_failure(run_dir: Path, rt: Runtime, created: bool):
    """A run directory this run created is removed when the run fails before its first checkpoint
    (nothing in it could be resumed or read); one with a checkpoint is kept, to be resumed."""
    try:
        yield
    except BaseException:
        if created and rt.is_main and not (run_dir / checkpoint.CHECKPOINTS / "latest").is_file():
            shutil.rmtree(run_dir, ignore_errors=True)
        raise


def resolve_schedule(recipe: Recipe, job: Job, rt: Runtime) -> Recipe:
    """A task's steps from finetune.epochs and its warmup from finetune.warmup_fraction."""
    ft, t = recipe.finetune, recipe.train
    if ft is not None and ft.epochs > 0:
        per_step = t.batch_size * t.grad_accum * rt.world_size
        steps = max(1, math.ceil(ft.epochs * job.examples / per_step))
        recipe = recipe_with(recipe, "train", steps=steps)
    if ft is not None and ft.warmup_fraction > 0:
        warmup = max(1, round(ft.warmup_fraction * recipe.train.steps))
        recipe = recipes.replace(recipe, schedule=recipes.replace(recipe.schedule, warmup_steps=warmup))
    if recipe.train.steps <= 0:
        raise UserError("train.steps is 0: give --steps (or, for a task, finetune.epochs)")
    steps, warmup = recipe.train.steps, recipe.schedule.warmup_steps
    if warmup > steps > 1:  # the run would never reach its peak learning rate, let alone decay
        clipped = max(1, steps // 10)
        if rt.is_main:
            console.print(
                f"[yellow]note:[/] schedule.warmup_steps {warmup} is longer than the run's {steps} steps: "
                f"warming up for {clipped} (a tenth of the run) instead"
            )
        recipe = recipes.replace(recipe, schedule=recipes.replace(recipe.schedule, warmup_steps=clipped))
    return recipe


def parameter_counts(module: ObjectiveModule) -> dict[str, int]:
    """Trained and total parameters of the model with its heads (the banner's and `compare`'s figures)."""
    return {
        "trained": sum(p.numel() for p in module.parameters() if p.requires_grad),
        "total": sum(p.numel() for p in module.parameters()),
    }


def write_run_files(
    recipe: Recipe,
    run_dir: Path,
    rt: Runtime,
    backbone: Backbone,
    job: Job,
    source: ModelSource | None,
    parameters: dict[str, int],
    plan: memory.Plan,
    vision_from: ModelSource | None = None,
) -> None:
    """The resolved recipe, the tokenizer, the plug-in's files, and run.json: where the model came
    from (and its vision tower, for a composed one), the command line, the versions and the memory
    plan (rank 0)."""
    if rt.is_main:
        recipes.save(recipe, run_dir / "config.yaml")
        record = {**run_record(run_dir, source, backbone, rt), "parameters": parameters, "memory_plan": plan.as_dict()}
        if vision_from is not None:
            record["vision_from"] = str(vision_from.path.resolve())
        checkpoint.write_atomic(run_dir / backbones.RUN_FILE, json.dumps(record, indent=1))
        if backbone.tokenizer is not None:
            backbone.tokenizer.save(run_dir)
        for name, data in job_files(job).items():
            (run_dir / name).write_text(data)


def run_record(run_dir: Path, source: ModelSource | None, backbone: Backbone, rt: Runtime) -> dict:
    """The provenance of a run: its --from (absolute, and the checkpoint read when it is a tfcli
    run), command lines (one per session), versions, device."""
    import sys

    import torch

    from . import __version__

    previous = backbones.recorded(run_dir)
    if "from" in previous:  # a resumed run keeps where it came from
        origin = {k: previous[k] for k in ("from", "from_checkpoint") if k in previous}
    else:
        origin = {"from": str(source.path.resolve()) if source else None}
        if backbone.checkpoint is not None:
            origin["from_checkpoint"] = str(Path(backbone.checkpoint).resolve())
    return {
        **origin,
        "commands": previous.get("commands", []) + [" ".join(["tfcli", *sys.argv[1:]])],
        "tfcli": __version__,
        "torch": torch.__version__,
        "device": str(rt.device),
        "processes": rt.world_size,
    }


def job_files(job: Job) -> dict[str, str]:
    """Files a plug-in keeps beside its checkpoints: a classifier's class names, and its own (Job.files)."""
    return {**({backbones.LABELS_FILE: json.dumps(list(job.labels))} if job.labels else {}), **job.files}


def new_run_dir(recipe: Recipe, out: Path | None) -> Path:
    """Where a new run goes: --out if it is absent or an empty directory, else runs/<recipe>-<time>
    (-2, -3, ... after it for another run of the recipe started within the same second; under torchrun
    rank 0's choice is broadcast)."""
    if out is None:
        stamped = Path("runs") / f"{recipe.name}-{time.strftime('%Y%m%d-%H%M%S')}"
        out, n = stamped, 1
        while out.exists():
            n += 1
            out = stamped.with_name(f"{stamped.name}-{n}")
        return out
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file; give a directory for the run")
    if (out / checkpoint.CHECKPOINTS).exists() or (out / "config.yaml").exists():
        raise UserError(f"{out} already holds a run; use --resume {out} or another --out")
    if out.exists() and any(out.iterdir()):
        raise UserError(f"--out {out} is a directory with other files in it; give a new or empty directory")
    return out


def banner(
    recipe: Recipe,
    plugin: Plugin,
    module: ObjectiveModule,
    backbone: Backbone,
    run_dir: Path,
    ckpt: Path | None,
    rt: Runtime,
) -> str:
    n = sum(p.numel() for p in backbone.model.parameters())
    trained, total = parameter_counts(module).values()
    how = f", training {trained:,} of {total:,} parameters ({100 * trained / max(total, 1):.2f}%" + (
        f", {recipe.finetune.train})" if recipe.finetune is not None else ")"
    )
    source = "" if backbone.source in ("scratch", str(run_dir)) else f" from {backbone.source}"
    processes = f", {rt.world_size} processes" if rt.world_size > 1 else ""
    where = f"{rt.device}{processes}" + (
        f", {rt.threads} CPU thread{'s' if rt.threads > 1 else ''}"
        + (" per process" if processes else "")
        + f" ({rt.threads_why})"
        if rt.device.type == "cpu"
        else ""
    )
    model = f"a {'new ' if not source and ckpt is None else ''}{n / 1e6:.2f}M-parameter {backbone.family}{source}"
    described = getattr(backbone.model, "describe", None)  # a family may say more of itself (a ViT's stem)
    described = described() if described else ""
    return (
        f"[bold]{plugin.title(recipe, backbone)}[/] on {model}{how}, {recipe.train.steps:,} steps on {where}, "
        f"recipe {recipe.name}, run directory [green]{run_dir}[/]"
        + (f" (resuming from {ckpt.name})" if ckpt else "")
        + (f"\n{described}" if described else "")
        + (f"\nadapters on {adapted}" if (adapted := adapters.adapted_modules(module)) else "")
        + quantized_note(module)
    )


def quantized_note(module: nn.Module) -> str:
    """QLoRA's base: how many block matrices are held in NF4 and what they take against fp32 (under FSDP,
    this process's share of each)."""
    held = [m for m in module.modules() if isinstance(m, NF4Linear)]
    if not held:
        return ""
    nf4_mb = sum(m.weight_bytes() for m in held) / 2**20
    fp32_mb = sum(m.held_weight().numel() * 4 for m in held) / 2**20
    sharded = " (this process's shares)" if any(m.sharded() for m in held) else ""
    return f"\n{len(held)} block matrices of the base in NF4{sharded}: {nf4_mb:,.1f} MB (fp32: {fp32_mb:,.1f} MB)"


# --- evaluation ---------------------------------------------------------------------------------


def evaluate(
    path: Path,
    key: str | None,
    settings: dict[str, Any],
    options: EvalOptions,
    default_recipes: dict[str, str] | None = None,
) -> dict[str, Any]:
    """`tfcli eval [KEY] --checkpoint RUN`: the run's own plug-in's evaluation, or plug-in KEY's
    (e.g. k-shot MNLI of a pretrained GPT); `settings` override the plug-in's recipe section. A
    Hugging Face directory or hub id is read with KEY's default recipe for its family
    (`default_recipes`), e.g. zero-shot cloze of a BERT or k-shot prompting of a GPT-2."""
    rt = setup_runtime(options.device)
    display.configure(not options.quiet)
    source = model_source.resolve(path, "--checkpoint")
    if not source.is_run:
        return evaluate_pretrained(source, key, settings, options, default_recipes or {}, rt)
    backbone = backbones.from_run(source.path, device=str(rt.device))
    recipe = backbone.recipe
    key = key or recipe.plugin
    kind = "objective" if key in registry.OBJECTIVES else "task"
    recipe = as_plugin(recipe, kind, key, settings)
    if options.precision:
        recipe = recipe_with(recipe, "train", precision=options.precision)
    plugin = make_plugin(kind, key, rt, options.quiet, options.named_code)
    if backbone.family not in plugin.families:
        raise UserError(
            f"{backbone.checkpoint} holds a {backbone.family!r} model; `eval {key}` needs "
            f"{' or '.join(repr(f) for f in plugin.families)}"
        )
    return plugin.evaluate(recipe, backbone, options)


def evaluate_pretrained(
    source: ModelSource,
    key: str | None,
    settings: dict[str, Any],
    options: EvalOptions,
    default_recipes: dict[str, str],
    rt: Runtime,
) -> dict[str, Any]:
    """A Hugging Face model evaluated as task KEY, with the task's recipe for its family."""
    family = source.family
    if key is None or key in registry.OBJECTIVES:
        raise UserError(
            f"--checkpoint {source} is a Hugging Face model: name the task to evaluate it on "
            f"(e.g. tfcli eval mnli --checkpoint {source} --cloze)"
        )
    # a family without a recipe of its own takes one of a family of its kind (ModernBERT: BERT's)
    same_kind = [r for f, r in default_recipes.items() if kind_of(f) == kind_of(family)]
    recipe_name = default_recipes.get(family) or (same_kind[0] if same_kind else None)
    if recipe_name is None:
        raise UserError(f"{key} has no recipe for a {family!r} model")
    plugin = make_plugin("task", key, rt, options.quiet, options.named_code)
    raw = recipes.load_raw(recipe_name)
    recipe = recipes.from_dict({**raw, key: {**(raw.get(key) or {}), **settings}})
    if options.precision:
        recipe = recipe_with(recipe, "train", precision=options.precision)
    backbone = backbones.from_hf(source, plugin.special_tokens(family))
    backbone.model.to(rt.device).eval()
    backbone.checkpoint = source.path
    return plugin.evaluate(plugin.resolve(recipe, backbone), backbone, options)


def as_plugin(recipe: Recipe, kind: str, key: str, settings: dict[str, Any]) -> Recipe:
    """The run's recipe, seen by plug-in `key` with `settings` over its section (its own when it is
    the run's plug-in; defaults otherwise)."""
    raw = recipes.to_dict(recipe, methods=False)
    if key != recipe.plugin:
        for k in (recipe.kind, recipe.plugin, "finetune"):
            raw.pop(k, None)
        raw[kind] = key
        if kind == "task":  # the run's pretraining text is not the task's data: the task's default (or --data)
            raw["data"] = {**raw.get("data", {}), "source": "", "val_source": ""}
    raw[key] = {**(raw.get(key) or {}), **settings}
    if not raw[key]:
        raw.pop(key)
    return recipes.from_dict(raw)
