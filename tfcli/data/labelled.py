"""Labelled text for classification: splits from a directory, files, a held-out share, or the hub;
text fields and a label read from every row; a label set given or learned from the training split.

A row whose text fields are missing or empty, or whose label is blank, '-' or negative (GLUE's "no
gold label"), is skipped and counted. A label outside a fixed label set, or a column that no row
has, is a one-line error naming the file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import UserError, listing, short
from .sources import load_hub_dataset
from .tables import EXTENSIONS, columns, read_table

SPLIT_ALIASES = {"dev": ("dev", "validation", "val", "test")}  # a held-out split by any of its usual names


@dataclass(frozen=True)
class TextSpec:
    """Where a classification task's text and labels are, and what its splits are called."""

    name: str  # the task's name in prompts ("mnli", "classify")
    text_fields: tuple[str, ...]
    label_field: str = "label"
    labels: tuple[str, ...] = ()  # empty: the training split's distinct labels, sorted
    splits: tuple[str, ...] = ("train", "dev")  # training split first
    hub: tuple[str, str] | None = None  # the default data: a Hugging Face dataset and config
    hub_splits: dict[str, str] = field(default_factory=dict)
    aliases: dict[str, tuple[str, ...]] = field(default_factory=dict)


@dataclass
class Split:
    rows: list  # (texts, label id) pairs
    skipped: int
    where: str

    @property
    def labels(self) -> np.ndarray:
        return np.array([y for _, y in self.rows], dtype=np.int64)


def load_splits(
    spec: TextSpec, source: str, val_source: str = "", val_fraction: float = 0.1, seed: int = 0, need_train: bool = True
) -> tuple[dict[str, Split], tuple[str, ...]]:
    """Every split of `spec` as usable rows, and the label names in id order. need_train=False
    (evaluation): a directory may hold the evaluation splits alone; the training split is then empty."""
    raw = raw_splits(spec, source, val_source, val_fraction, seed, need_train)
    train_split = spec.splits[0]
    learn_from = (
        train_split if raw[train_split][0] else next(s for s in spec.splits if raw[s][0] or s == spec.splits[-1])
    )
    labels = spec.labels or _learn_labels(raw[learn_from][0], spec, raw[learn_from][2])
    return {name: _rows(spec, *split, labels) for name, split in raw.items()}, labels


def balanced_sample(labels: np.ndarray, n: int, seed: int) -> np.ndarray:
    """Sorted indices of a seeded sample of n rows, as even over the labels as the data allows."""
    if n <= 0 or n >= len(labels):
        return np.arange(len(labels))
    rng = np.random.default_rng(seed)
    pools = [rng.permutation(np.flatnonzero(labels == c)) for c in np.unique(labels)]
    picked, i = [], 0
    while len(picked) < n:  # round-robin over the labels' shuffled rows
        pool = pools[i % len(pools)]
        if i // len(pools) < len(pool):
            picked.append(pool[i // len(pools)])
        i += 1
    return np.sort(np.array(picked))


def raw_splits(
    spec: TextSpec, source: str, val_source: str, val_fraction: float, seed: int, need_train: bool = True
) -> dict:
    """{split: (row dicts, rows skipped while reading, where they came from, their row numbers there)}."""
    if not source:
        if spec.hub is None:
            raise UserError(f"{spec.name}: give the data with --data (a file or a directory of split files)")
        return {s: _hub_split(*spec.hub, spec.hub_splits.get(s, s)) for s in spec.splits}
    if source.startswith("hf:"):
        name, _, config = source[3:].partition(":")
        return {s: _hub_split(name, config or None, "validation" if s == "dev" else s) for s in spec.splits}
    path = Path(source)
    if path.is_dir():
        return _directory_splits(path, spec, need_train)
    if not path.is_file():
        raise UserError(f"data not found: {source}")
    train = _numbered(*read_table(path), str(path))
    if val_source:
        return {spec.splits[0]: train, "dev": _numbered(*read_table(Path(val_source)), val_source)}
    return _held_out(train, spec.splits[0], val_fraction, seed)


def row_splits(rows: dict[str, list[dict]], where: str, train_name: str, fraction: float, seed: int) -> dict:
    """Rows made in memory ({split: rows}, the training split first) as raw_splits gives a file's; a
    training split alone has `fraction` of it held out as dev, as one data file has."""
    out = {split: _numbered(r, 0, f"{where} ({split})") for split, r in rows.items()}
    if len(out) == 1 and train_name in out:
        return _held_out(_numbered(rows[train_name], 0, where), train_name, fraction, seed)
    return out


def held_out_rows(path: Path, fraction: float, seed: int) -> list[dict]:
    """The rows of one data file that training holds out (data.val_fraction, seeded by train.seed):
    what an evaluation of the same model without training must score to be compared with it."""
    return _held_out(_numbered(*read_table(Path(path)), str(path)), "train", fraction, seed)["dev"][0]


def _numbered(rows: list, skipped: int, where: str) -> tuple:
    return rows, skipped, where, list(range(1, len(rows) + 1))


def _directory_splits(directory: Path, spec: TextSpec, need_train: bool) -> dict:
    """The split files a directory holds: the training split (required to train; empty for an
    evaluation), then every evaluation split that is there (at least one must be); the ones that are
    not are named in one note line."""
    first, *evaluation = spec.splits
    present = {s: _split_file(directory, s) for s in evaluation if _split_path(directory, s) is not None}
    if evaluation and not present:
        wanted = " or ".join(f"{s}{EXTENSIONS[0]}" for s in evaluation)
        raise UserError(f"{directory}: no evaluation split file ({wanted}, or another of {', '.join(EXTENSIONS)})")
    absent = [s for s in evaluation if s not in present]
    if absent:
        from ..display import console

        console.print(
            f"[yellow]note:[/] {directory} has no {' or '.join(absent)} file: "
            f"{'scoring' if not need_train else 'evaluating on'} {', '.join(present)} only"
        )
    return {first: _split_file(directory, first, optional=not need_train), **present}


def _split_path(directory: Path, split: str) -> Path | None:
    """The file holding `split` in `directory` (its name or an alias, any known extension), if any."""
    for name in SPLIT_ALIASES.get(split, (split,)):
        for ext in EXTENSIONS:
            if (directory / f"{name}{ext}").is_file():
                return directory / f"{name}{ext}"
    return None


def _split_file(directory: Path, split: str, optional: bool = False) -> tuple:
    path = _split_path(directory, split)
    if path is not None:
        return _numbered(*read_table(path), str(path))
    if optional:
        return [], 0, str(directory / split), []
    raise UserError(f"{directory}: no {split} file ({', '.join(split + e for e in EXTENSIONS)})")


def _hub_split(name: str, config: str | None, split: str) -> tuple:
    ds = load_hub_dataset(
        name, config, split, instead="pass --data with local files (a directory of train/dev files, or one file)"
    )
    return _numbered(ds.to_list(), 0, f"hf:{name}" + (f":{config}" if config else "") + f" {split}")


def _held_out(train: tuple, train_name: str, fraction: float, seed: int) -> dict:
    rows, skipped, where, numbers = train
    if not 0 < fraction < 1:
        raise UserError("one data file and data.val_fraction 0: give a dev file (data.val_source) or a fraction")
    order = np.random.default_rng([seed, 4242]).permutation(len(rows))
    n_dev = max(1, int(len(rows) * fraction))
    dev, kept = sorted(order[:n_dev]), sorted(order[n_dev:])
    return {
        train_name: ([rows[i] for i in kept], skipped, where, [numbers[i] for i in kept]),
        "dev": ([rows[i] for i in dev], 0, f"{where} (held-out {fraction:g})", [numbers[i] for i in dev]),
    }


def _field(spec: TextSpec, name: str, present: list[str], where: str) -> str:
    """The column holding `name` (it or one of its aliases)."""
    for candidate in (name, *spec.aliases.get(name, ())):
        if candidate in present:
            return candidate
    raise UserError(
        f"{where}: no column {name!r} (columns: {listing(present) or 'none'}); set the task's text and label fields"
    )


def _label_id(value, labels: tuple[str, ...], where: str, n: int) -> int | None:
    """A label by name (any case), or a word-label set's id; None for 'no label' (blank, '-', < 0)."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    text = "" if value is None else str(value).strip()
    if text in ("", "-") or (text.lstrip("-").isdigit() and int(text) < 0):
        return None
    if text in labels:
        return labels.index(text)
    lowered = [label.lower() for label in labels]
    if text.lower() in lowered:
        return lowered.index(text.lower())
    if text.isdigit() and int(text) < len(labels):
        return int(text)
    raise UserError(f"{where}: row {n}: unknown label {short(repr(value))} (labels: {listing(labels)})")


MAX_LABELS = 1000  # more distinct values than this is a text column, not labels


def _learn_labels(rows: list[dict], spec: TextSpec, where: str) -> tuple[str, ...]:
    if not rows:
        raise UserError(f"{where}: no rows")
    col = _field(spec, spec.label_field, columns(rows), where)
    values = {str(r[col]).strip() for r in rows if r.get(col) is not None}
    values = {v for v in values if v not in ("", "-") and not (v.lstrip("-").isdigit() and int(v) < 0)}
    if len(values) < 2:
        raise UserError(f"{where}: column {col!r} has {len(values)} distinct label(s); classification needs 2 or more")
    if len(values) > MAX_LABELS or (len(values) > 20 and len(values) > len(rows) // 2):
        raise UserError(
            f"{where}: column {col!r} has {len(values):,} distinct values in {len(rows):,} rows "
            f"({listing(sorted(values), 3)}): not a label column; name the labels' column with --label-field"
        )
    numeric = all(v.isdigit() for v in values)
    return tuple(sorted(values, key=int if numeric else str))


def _rows(
    spec: TextSpec, rows: list[dict], skipped: int, where: str, numbers: list[int], labels: tuple[str, ...]
) -> Split:
    present = columns(rows)
    if not rows:
        return Split([], skipped, where)
    fields = [_field(spec, f, present, where) for f in spec.text_fields]
    label_col = _field(spec, spec.label_field, present, where)
    out = []
    for n, row in zip(numbers, rows):
        texts = tuple(row.get(f) for f in fields)
        label = _label_id(row.get(label_col), labels, where, n)
        if label is None or not all(isinstance(t, str) and t.strip() for t in texts):
            skipped += 1
            continue
        out.append((texts, label))
    return Split(out, skipped, where)
