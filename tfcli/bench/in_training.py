"""Benchmarks inside the training loop (train.eval_tasks): the questions read and encoded once, when
the run is set up, and scored at every evaluation by the same log-likelihood scorer as `tfcli eval`,
on the model being trained; their acc and acc_norm join the evaluation's metrics (val_piqa_acc_norm),
so runs, plot and the loggers show them and train.select_by may pick the best checkpoint by them."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from ..errors import UserError
from ..models import kinds
from . import loglik, report, spec

SCORED_AT_ONCE = 16  # rows per batch: the loop's memory is the training's, not a free machine's


@dataclass(frozen=True)
class Read:
    name: str  # the metrics' prefix: piqa, mmlu, mmlu_anatomy, my_bench (a file's stem)
    entry: str  # as train.eval_tasks names it
    questions: list


@dataclass(frozen=True)
class Planned:
    name: str
    questions: list
    requests: list


def read(entries: tuple[str, ...], data: str, few_shot: int) -> list[Read]:
    """Each `name[:N]` of train.eval_tasks, its questions read and checked (an unknown benchmark, a
    missing file, a broken row): before any model is read."""
    out = []
    for entry in entries:
        name, _, count = str(entry).partition(":")
        bench = spec.load(name)
        parts = bench.parts
        each = math.ceil(int(count) / len(parts)) if count else 0  # mmlu:300 -> 6 questions of each subject
        if not data and not bench.data:
            raise UserError(
                f"train.eval_tasks: {name} needs train.eval_tasks_data, the directory holding "
                f"{', '.join(bench.files.values())} (or one holding a {name} directory)"
            )
        root = spec.data_root(bench, data or None, "train.eval_tasks_data")
        questions = [q for part in parts for q in spec.questions(part, root, few_shot, each)]
        out.append(Read(Path(name).stem, name, questions))
    return out


def plan(benchmarks: list[Read], model: nn.Module, tokenizer) -> list[Planned]:
    """The questions read, encoded for the run's model: a question longer than the model is refused now,
    before the run starts."""
    if benchmarks and model.kind not in kinds.GENERATIVE:
        raise UserError(
            f"train.eval_tasks: benchmarks score each choice's log-likelihood, which needs a decoder or an "
            f"encoder-decoder; this run trains a {model.kind} ({model.cfg.family})"
        )
    out = []
    for b in benchmarks:
        requests = loglik.requests(tokenizer, b.questions, spec.load(b.entry).target_delimiter)
        loglik.check_fits(model, requests, f"train.eval_tasks: {b.entry}")
        out.append(Planned(b.name, b.questions, requests))
    return out


def metric_names(planned: list[Planned]) -> list[str]:
    return [f"{p.name}_{m}" for p in planned for m in ("acc", "acc_norm")]


def scorer(planned: list[Planned], pad: int, precision: str, device) -> Callable[[nn.Module], dict[str, float]]:
    """module (the trainer's ObjectiveModule, wrapped or not) -> {piqa_acc: .., piqa_acc_norm: ..}.
    Eval mode and no gradients while scoring, the module's mode restored after; nothing random."""
    from ..engine.runtime import autocast_context

    def score_all(module: nn.Module) -> dict[str, float]:
        was = module.training
        module.eval()
        out = {}
        try:
            for p in planned:

                def run(model, heads, batch, p=p):
                    with torch.no_grad(), autocast_context(precision, device):
                        return loglik.score(model, p.requests, pad, SCORED_AT_ONCE)

                rows = report.per_question(p.questions, module(None, fn=run))
                metrics = report.metrics(rows)
                out[f"{p.name}_acc"], out[f"{p.name}_acc_norm"] = metrics["acc,none"], metrics["acc_norm,none"]
        finally:
            module.train(was)
        return out

    return score_all


def add_to(job, planned: list[Planned], pad: int, precision: str, device):
    """The job with its evaluation scoring the benchmarks too (after the task's own metrics)."""
    if not planned:
        return job
    score_all, own = scorer(planned, pad, precision, device), job.evaluate

    def evaluate(module: nn.Module, run_dir: Path) -> dict[str, float]:
        return {**(own(module, run_dir) if own is not None else {}), **score_all(module)}

    return replace(job, evaluate=evaluate)


def select_by(job, metric: str, benchmarks: list[str]):
    """The job picking its best checkpoint by `metric` (train.select_by, as logged: val_<name>), the
    lowest for a loss or perplexity, else the highest. Refused in one line unless the run logs it."""
    if not metric:
        return job
    key = metric.removeprefix("val_")
    held_out = sorted(_held_out_names(job))
    known = [*held_out, *benchmarks, *([job.best_key] if job.best_key else [])]
    if key not in known:
        raise UserError(
            f"train.select_by {metric}: this run logs {', '.join('val_' + k for k in known) or 'no held-out metric'}"
            f" (a benchmark's: add it to train.eval_tasks)"
        )
    return replace(job, best_key=key, best_lowest=key == "loss" or "loss" in key or key.endswith("ppl"))


def _held_out_names(job) -> set[str]:
    """The held-out metrics a job logs: its loss and what held_out_metrics derives from it."""
    if job.val is None:
        return set()
    try:
        return set(job.held_out_metrics({"loss": 1.0}))
    except (KeyError, TypeError, ValueError):
        return {"loss"}
