"""eval and export: what reads a trained run (or a Hugging Face model) and reports on it or writes it out."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import typer

from .. import registry
from ..errors import UserError
from .common import (
    CHECKPOINT,
    DEVICE,
    PRECISION,
    QUIET,
    check_device,
    named_code,
    newest,
    recipes,
    task_target,
    user_errors,
)


@user_errors
def eval_(
    task: str | None = typer.Argument(
        None,
        help="What to evaluate as (mnli, classify, image-classify, mae, ...); omit for the run's own objective or task.",
    ),
    checkpoint: Path | None = CHECKPOINT,
    data: str | None = typer.Option(None, help="Evaluate on this data instead of the run's."),
    batches: int = typer.Option(0, help="Held-out batches for pretraining runs (0: the recipe's train.eval_batches)."),
    limit: int = typer.Option(
        0,
        help="Classification: a seeded, class-balanced sample of N examples of each split; generative tasks and benchmarks: the first N (0: all).",
    ),
    out: Path | None = typer.Option(
        None, help="Write the report (or the MAE picture) here [default: beside the run, eval-<what>.json]."
    ),
    premise: str | None = typer.Option(None, help="MNLI: classify this premise ..."),
    hypothesis: str | None = typer.Option(None, help="... with this hypothesis, and print the label probabilities."),
    input_: list[str] = typer.Option([], "--input", help="Classify this input (repeat for a pair's second text)."),
    few_shot: int = typer.Option(
        -1, help="Score an un-finetuned decoder/encoder-decoder with k solved examples in the prompt (-1: off)."
    ),
    cloze: bool = typer.Option(
        False, "--cloze", help="Zero-shot BERT: label words scored at a [MASK] in a template by the MLM head."
    ),
    seed: int = typer.Option(0, help="Seed for sampled examples (few-shot, --limit, masking)."),
    device: str | None = DEVICE,
    precision: str | None = PRECISION,
    quiet: bool = QUIET,
    set_: list[str] = typer.Option(
        [], "--set", help="A setting of the evaluated task, e.g. --set sft.max_new_tokens=64 (repeatable)."
    ),
    reference: str | None = typer.Option(
        None, help="dpo: the model rewards are measured against [default: the run's reference]."
    ),
    batch_size: str = typer.Option(
        "16", help="Benchmarks: rows scored at once, or auto (the most the free memory holds, halved on out-of-memory)."
    ),
    log_samples: bool = typer.Option(
        False,
        "--log-samples",
        help="Benchmarks: also write each question's choices, log-likelihoods and prediction (lm-eval's --log_samples), a JSON Lines file per benchmark beside the results.",
    ),
    reward: str | None = typer.Option(
        None,
        help="grpo: the reward(s) to score with [default: the run's; a file.py:function of yours runs only when named here].",
    ),
    tools: str | None = typer.Option(
        None,
        help="grpo: the tools the model may call [default: the run's; a file.py:function of yours runs only when named here].",
    ),
    env: str | None = typer.Option(
        None, help="grpo: the environment class (file.py:Class) [default: the run's; imported only when named here]."
    ),
):
    """Metrics of a run (or of a Hugging Face model as a task): held-out loss and perplexity, a task's
    report, or standard benchmarks scored as lm-evaluation-harness scores them (tfcli eval piqa,mmlu)."""
    from ..bench import report as bench_report
    from ..bench.spec import is_benchmark
    from ..driver import evaluate
    from ..plugin import EvalOptions

    code = named_code({"reward": reward, "tools": tools, "env": env}, set_)
    if task is not None and not is_benchmark(task) and task not in registry.OBJECTIVES:
        from ..tasks.presets import PRESETS

        if task not in registry.TASKS and task not in PRESETS:
            raise UserError(
                f"unknown task or benchmark {task!r} (tasks: {', '.join(sorted([*registry.TASKS, *PRESETS]))};"
                f" benchmarks: piqa, mmlu, mmlu_cloze, mmlu_<subject>, or a benchmark .yaml file)"
            )
    if task is not None and is_benchmark(task):
        from ..bench import run as bench_run
        from ..bench.run import BenchRequest
        from ..engine.runtime import pick_device

        check_device(device)
        rows_at_once = 0 if batch_size == "auto" else int(batch_size) if batch_size.isdigit() else -1
        if rows_at_once < 0 or batch_size == "0" or limit < 0:
            raise UserError(f"--batch-size {batch_size}: give a number >= 1 or auto (and --limit >= 0)")
        names = [n.strip() for n in task.split(",") if n.strip()]
        tasks = [n for n in names if n in registry.TASKS or n in _presets()]
        req = BenchRequest(
            [n for n in names if n not in tasks],
            newest(checkpoint),
            data,
            max(few_shot, 0),
            limit,
            rows_at_once,
            out,
            str(pick_device(device or "auto")),
            quiet,
            log_samples=log_samples,
        )
        prepared = bench_run.prepare(req)  # every benchmark read, encoded and fitted before a task runs
        scored = bench_report.sections()
        for name in tasks:  # tasks of their own (gsm8k, mnli) beside the benchmarks: their own scorers
            key, settings, defaults = task_target(name)
            options = EvalOptions(
                data=_task_data(data, name),
                limit=limit,
                out=out.with_name(f"{out.stem}-{name}.json") if out else None,  # --out decides where all goes
                device=device or "auto",
                quiet=quiet,
                named_code=code,
            )
            report = evaluate(newest(checkpoint), key, settings, options, defaults)
            scored = bench_report.joined(scored, bench_report.task_results(name, report, max(few_shot, 0)))
        bench_run.run(replace(req, tasks=scored), prepared)
        return

    if log_samples:
        raise UserError("--log-samples writes benchmarks' questions (tfcli eval piqa,mmlu ...); a task writes its own")
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
            raise UserError(f"--set {item}: eval takes settings of the task it runs, {_settings_of(key)}")
        settings[name] = value
    for name, value in (("reward", reward), ("tools", tools), ("env", env)):
        if value is None:
            continue
        if key not in (None, "grpo"):
            raise UserError(f"--{name} is an option of eval grpo (this is eval {task})")
        settings[name] = value
    evaluate(
        newest(checkpoint),
        key,
        settings,
        EvalOptions(
            data=data,
            limit=limit,
            batches=batches,
            out=out,
            inputs=inputs,
            few_shot=few_shot,
            cloze=cloze,
            seed=seed,
            device=device or "auto",
            precision=precision,
            quiet=quiet,
            reference=reference,
            named_code=code,
        ),
        defaults,
    )


@user_errors
def export(
    hf: Path | None = typer.Option(None, "--hf", help="Write a Hugging Face transformers directory here."),
    gguf: Path | None = typer.Option(
        None, "--gguf", help="Write a GGUF file here (llama-family runs: llama.cpp, Ollama, tfcli)."
    ),
    gguf_type: str = typer.Option("f16", "--gguf-type", help="GGUF matrices: f32, f16 or q8_0 (norms stay f32)."),
    peft: Path | None = typer.Option(
        None, "--peft", help="A LoRA run: write its adapters, unmerged, as a PEFT directory here."
    ),
    checkpoint: Path | None = CHECKPOINT,
):
    """Export a run (its best checkpoint, else its latest) as a directory transformers can load, or a GGUF file."""
    from ..display import console
    from ..engine import model_source
    from ..engine.backbone import for_inference
    from ..hf import convert, interop
    from ..hf.gguf import WRITE_TYPES

    if hf is None and gguf is None and peft is None:
        raise UserError(
            "name what to write: --hf DIR (transformers), --gguf FILE (llama.cpp) and/or --peft DIR "
            "(a LoRA run's adapters)"
        )
    if gguf is not None and gguf_type not in WRITE_TYPES:
        raise UserError(f"--gguf-type {gguf_type}: choose {', '.join(WRITE_TYPES)}")
    if gguf is not None and gguf.exists():
        raise UserError(f"{gguf} exists; choose a new --gguf file")
    if hf is not None:
        convert.check_writable(hf)
    source = newest(checkpoint)
    # a run (its best checkpoint), or what eval and generate read: a Hugging Face directory, a GGUF, a hub id
    backbone = for_inference(source)
    if peft is not None:  # first: the adapters unmerged (the other exports merge them into the model)
        from ..engine.backbone import recorded

        record = recorded(backbone.run_dir)
        base = record.get("from_checkpoint") or record.get("from") or "(the run's base model)"
        base_source = model_source.recorded(base)
        loadable = base_source is None or base_source.transformers_can_name  # else written beside the adapters
        loads_with = interop.export_peft(backbone, backbone.recipe, base, peft, lambda: for_inference(base), loadable)
        console.print(f"wrote LoRA adapters to {peft}\nload them with:  {loads_with}", soft_wrap=True)
    if hf is not None:
        arch, loads_with = interop.export(backbone, backbone.recipe, hf)
        console.print(f"wrote {arch} to {hf}\nload it with:  {loads_with}", soft_wrap=True)
    if gguf is not None:
        arch = interop.export_gguf(backbone, backbone.recipe, gguf, gguf_type)
        console.print(
            f"wrote a {gguf_type} GGUF ({arch}) to {gguf}\nrun it with:  tfcli generate --checkpoint {gguf}",
            soft_wrap=True,
        )


def _presets():
    from ..tasks.presets import PRESETS

    return PRESETS


def _task_data(data: str | None, name: str) -> str | None:
    """A task's data in a list with benchmarks: --data itself, or its subdirectory named after the task."""
    if data and (Path(data) / name).is_dir():
        return str(Path(data) / name)
    return data


def _settings_of(key: str | None) -> str:
    """What `--set` takes for the evaluated task: its recipe section's fields."""
    import dataclasses

    from ..tasks.presets import PRESETS

    task = PRESETS[key].task if key in PRESETS else key
    kind = "objective" if task in registry.OBJECTIVES else "task"
    config = registry.plugin_class(kind, task).Config if task is not None else None
    if config is None:
        return "e.g. --set sft.max_new_tokens=64"
    names = [f.name for f in dataclasses.fields(config)]
    return f"{task}.<field> with a field of {', '.join(names)}"
