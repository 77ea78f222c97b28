"""Loss curves as PNG: one run's train and held-out loss with its learning rate (written at each
evaluation as RUN/curves.png), or several runs overlaid (`tfcli plot`).

A held-out metric has one name wherever a user types or reads it: val_<name> (train.select_by,
`tfcli runs`, a checkpoint's meta.json, `tfcli plot --metric val_piqa_acc_norm`); metrics.jsonl keeps
it as <name> on its rows of split "val"."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import UserError


def read_metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise UserError(f"{run_dir}: no metrics.jsonl; is it a tfcli run?")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _series(records: list[dict], split: str, metric: str) -> tuple[list[int], list[float]]:
    rows = [r for r in records if r.get("split", "train") == split and metric in r]
    return [r["step"] for r in rows], [r[metric] for r in rows]


NOT_METRICS = {"step", "split", "reason", "lr", "elapsed_s"}


def split_metric(metric: str, split: str) -> tuple[str, str]:
    """(split, metric as metrics.jsonl keys it): val_piqa_acc_norm is the val rows' piqa_acc_norm."""
    for prefix in ("val", "train"):
        if metric.startswith(prefix + "_"):
            return prefix, metric[len(prefix) + 1 :]
    return split, metric


def named(row: dict, key: str) -> str:
    """A metric of a metrics.jsonl row by its one name (val_<key> on a held-out row)."""
    return f"val_{key}" if row.get("split") == "val" else key


def require_metric(records: list[list[dict]], metric: str) -> None:
    """A metric none of the runs logged is a one-line error listing the ones they did (val_<name>
    for the held-out ones)."""
    split, key = split_metric(metric, "")
    if any(key in r and split in ("", r.get("split", "train")) for rows in records for r in rows):
        return
    known = sorted(
        {
            named(r, k)
            for rows in records
            for r in rows
            for k, v in r.items()
            if k not in NOT_METRICS and isinstance(v, (int, float))
        }
    )
    shown = ", ".join(known[:20]) + (f", ... ({len(known)} in all)" if len(known) > 20 else "")
    raise UserError(f"--metric {metric}: no run logged it; they have {shown or 'no metrics yet'}")


def figure():
    """matplotlib's pyplot, drawing to files only (a plot is never a window)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    return plt


def run_curves(run_dir: Path, out: Path, metric: str = "loss") -> Path:
    """One run: training and held-out `metric` against the step, the learning rate on a second axis."""
    records = read_metrics(run_dir)
    require_metric([records], metric)
    only, key = split_metric(metric, "")
    plt = figure()
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    for split, style in (("train", "-"), ("val", "o-")):
        steps, values = _series(records, split, key) if only in ("", split) else ([], [])
        if steps:
            ax.plot(steps, values, style, label=f"{split} {key}", markersize=3)
    ax.set_xlabel("step")
    ax.set_ylabel(key)
    ax.grid(alpha=0.3)
    steps, lrs = _series(records, "train", "lr")
    if steps:
        lr_ax = ax.twinx()
        lr_ax.plot(steps, lrs, color="0.6", linewidth=1, label="lr")
        lr_ax.set_ylabel("learning rate", color="0.4")
    ax.legend(loc="upper right")
    ax.set_title(Path(run_dir).name, fontsize=10)
    return save_figure(fig, plt, out)


def expert_load(run_dir: Path, out: Path) -> Path | None:
    """A mixture of experts' routing: each MoE layer's busiest expert over the mean (1: balanced; the
    number of experts: one expert takes every token) at each held-out evaluation (None: the run has no
    experts)."""
    rows = [r for r in read_metrics(run_dir) if r.get("split") == "experts"]
    if not rows:
        return None
    from ..models.moe import imbalance

    plt = figure()
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    steps = [r["step"] for r in rows]
    for layer in range(len(rows[-1]["load"])):
        values = [imbalance(r["load"][layer]) if layer < len(r["load"]) else float("nan") for r in rows]
        ax.plot(steps, values, "o-", markersize=3, label=f"MoE layer {layer}")
    ax.set_xlabel("step")
    ax.set_ylabel("busiest expert / mean (held out)")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right", fontsize=7)
    ax.set_title(f"{Path(run_dir).name}: expert load", fontsize=10)
    return save_figure(fig, plt, out)


def compare_runs(runs: list[Path], out: Path, metric: str = "loss", split: str = "val") -> Path:
    """Several runs' `metric` on one split, overlaid (the train split when a run has no held-out rows)."""
    every = [read_metrics(run) for run in runs]
    require_metric(every, metric)
    split, metric = split_metric(metric, split)
    plt = figure()
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    for run, records in zip(runs, every):
        steps, values = _series(records, split, metric)
        if not steps:
            steps, values = _series(records, "train", metric)
        if steps:
            ax.plot(steps, values, "-", marker="o" if len(steps) < 30 else None, markersize=3, label=Path(run).name)
    ax.set_xlabel("step")
    ax.set_ylabel(f"{split} {metric}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, plt, out)


MARGINS = {"left": 0.11, "right": 0.87, "top": 0.92, "bottom": 0.13}  # room for the tick labels and the lr axis


def save_figure(fig, plt, out: Path) -> Path:
    """Write `fig` to `out` whole (a temporary file renamed into place) and close it."""
    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp.png")
    fig.subplots_adjust(**MARGINS)  # fixed: tight_layout was half of the drawing's time, at every evaluation
    fig.savefig(tmp)
    plt.close(fig)
    tmp.replace(out)
    return out
