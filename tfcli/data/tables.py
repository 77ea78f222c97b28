"""Rows of a labelled data file: CSV, TSV (GLUE's, unquoted), JSON Lines, a JSON list, or parquet.

Every reader returns plain dicts, one per row, and how many lines could not be read as a row (a
broken JSON line, a short TSV line): those are skipped and counted, never a traceback. A file that
cannot be read at all is a one-line error naming it.
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

from ..errors import UserError

EXTENSIONS = (".tsv", ".csv", ".jsonl", ".json", ".parquet")


def read_table(path: Path) -> tuple[list[dict], int]:
    """(rows as dicts, lines skipped as unreadable)."""
    path = Path(path)
    reader = {
        ".tsv": _read_delimited,
        ".csv": _read_delimited,
        ".jsonl": _read_jsonl,
        ".json": _read_json,
        ".parquet": _read_parquet,
    }.get(path.suffix.lower())
    if reader is None:
        raise UserError(f"{path}: unsupported data file (use {', '.join(EXTENSIONS)})")
    try:
        return reader(path)
    except UnicodeDecodeError:
        raise UserError(f"{path}: not UTF-8 text") from None
    except OSError as e:
        raise UserError(f"{path}: could not be read ({e.strerror or e})") from None


def columns(rows: list[dict]) -> list[str]:
    return list(dict.fromkeys(k for r in rows[:100] for k in r))


def _read_delimited(path: Path) -> tuple[list[dict], int]:
    """CSV with quoting; TSV without (GLUE's MNLI files hold unbalanced quotes)."""
    csv.field_size_limit(sys.maxsize)
    tsv = path.suffix.lower() == ".tsv"
    with open(path, encoding="utf-8", newline="") as f:
        reader = csv.reader(f, delimiter="\t" if tsv else ",", quoting=csv.QUOTE_NONE if tsv else csv.QUOTE_MINIMAL)
        header = next(reader, None) or []
        rows, skipped = [], 0
        for rec in reader:
            if len(rec) < len(header):
                skipped += bool(any(x.strip() for x in rec))  # a blank line is not a row
                continue
            rows.append(dict(zip(header, rec)))
    return rows, skipped


def _read_jsonl(path: Path) -> tuple[list[dict], int]:
    rows, skipped = [], 0
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            skipped += 1
            continue
        rows.append(obj) if isinstance(obj, dict) else None
        skipped += not isinstance(obj, dict)
    return rows, skipped


def _read_json(path: Path) -> tuple[list[dict], int]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: not valid JSON (line {e.lineno}); JSON Lines files end in .jsonl") from None
    if isinstance(data, dict):  # {"data": [...]} or a dict of columns
        lists = [v for v in data.values() if isinstance(v, list)]
        data = lists[0] if len(lists) == 1 else [dict(zip(data, vals)) for vals in zip(*data.values())]
    if not isinstance(data, list):
        raise UserError(f"{path}: expected a list of rows")
    rows = [r for r in data if isinstance(r, dict)]
    return rows, len(data) - len(rows)


def _read_parquet(path: Path) -> tuple[list[dict], int]:
    import pyarrow.parquet as pq  # pyarrow comes with datasets
    from pyarrow import ArrowException

    try:
        return pq.read_table(path).to_pylist(), 0
    except (ArrowException, OSError) as e:
        raise UserError(f"{path}: not a readable parquet file ({str(e).splitlines()[0][:120]})") from None
