"""The runs under a directory: what each is, how far it got, its best metric; the newest unfinished
one of a recipe (`--resume auto`)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from ..engine import checkpoint
from ..errors import UserError


@dataclass
class RunInfo:
    path: Path
    recipe: str
    family: str
    what: str  # objective or task (and preset)
    step: int
    steps: int
    best: str  # the headline metric, as text
    when: float  # seconds since the epoch of the newest checkpoint (or of config.yaml)

    @property
    def finished(self) -> bool:
        return self.step >= self.steps > 0


def describe(run: Path) -> RunInfo | None:
    """A run directory's summary (None when it is not a tfcli run)."""
    config = run / "config.yaml"
    try:
        raw = yaml.safe_load(config.read_text()) if config.is_file() else None
    except yaml.YAMLError:
        return None
    if not isinstance(raw, dict) or not (raw.get("objective") or raw.get("task")):
        return None
    plugin = raw.get("objective") or raw.get("task")
    preset = (raw.get(plugin) or {}).get("preset") if isinstance(raw.get(plugin), dict) else None
    latest = run / checkpoint.CHECKPOINTS / "latest"
    meta = {}
    if latest.is_file():
        try:
            meta = checkpoint.read_meta(run / checkpoint.CHECKPOINTS / latest.read_text().strip())
        except UserError:
            meta = {}
    return RunInfo(
        run,
        str(raw.get("name", "")),
        str((raw.get("model") or {}).get("family", "?")),
        f"{plugin} ({preset})" if preset else str(plugin),
        int(meta.get("step", 0)),
        int((raw.get("train") or {}).get("steps", 0)),
        _selected(run, str((raw.get("train") or {}).get("select_by") or "")) or _best(run, meta),
        (latest if latest.is_file() else config).stat().st_mtime,
    )


SCORES = (
    "acc",
    "exact_match",
    "contains_match",
    "reward",
)  # what a split of eval.json is judged by, by kind of task (GRPO: its mean reward)


def split_scores(report: dict) -> dict[str, tuple[str, float]]:
    """Each split of an eval.json with its headline score: a classifier's accuracy (acc), or the share
    of generated replies right (exact_match, contains_match)."""
    out = {}
    for split, result in report.items():
        key = next((k for k in SCORES if isinstance(result, dict) and k in result), None)
        if key is not None:
            out[split] = (key, float(result[key]))
    return out


def _selected(run: Path, metric: str) -> str:
    """The metric train.select_by names, at the checkpoint it picked ("" when the run names none)."""
    pointer = run / checkpoint.CHECKPOINTS / "best"
    if not metric or not pointer.is_file():
        return ""
    try:
        meta = checkpoint.read_meta(run / checkpoint.CHECKPOINTS / pointer.read_text().strip())
    except UserError:
        return ""
    return f"{metric} {meta[metric]:.4f}" if isinstance(meta.get(metric), (int, float)) else ""


def _best(run: Path, meta: dict) -> str:
    """A task's first-split score from its report, else the held-out loss of the last evaluation."""
    report = run / "eval.json"
    if report.is_file():
        scores = split_scores(json.loads(report.read_text()))
        if scores:
            split, (key, value) = next(iter(scores.items()))
            return f"{split} {key} {value:.4f}" if key == "reward" else f"{split} {key} {100 * value:.2f}%"
    for key in ("val_loss", "loss"):
        if key in meta:
            return f"{key} {meta[key]:.4f}"
    return ""


def list_runs(root: Path) -> list[RunInfo]:
    """Every run directly under root, newest first."""
    if not Path(root).is_dir():
        raise UserError(f"no runs directory {root}")
    infos = [describe(p) for p in sorted(Path(root).iterdir()) if p.is_dir()]
    return sorted((i for i in infos if i is not None), key=lambda i: i.when, reverse=True)


def newest_unfinished(root: Path, recipe_name: str) -> Path:
    """`--resume auto`: the newest run of this recipe that has not reached its train.steps."""
    candidates = (
        [i for i in list_runs(root) if i.recipe == recipe_name and not i.finished] if Path(root).is_dir() else []
    )
    if not candidates:
        raise UserError(f"--resume auto: no unfinished run of recipe {recipe_name!r} under {root}/")
    return candidates[0].path


def age(when: float) -> str:
    seconds = time.time() - when
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f} {unit} ago"
    return "just now"
