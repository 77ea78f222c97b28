"""Documents of text, read as a stream, never a whole corpus in memory.

A source is the built-in corpus, local files, or a Hugging Face dataset (`hf:name[:config[:split]]`).
A plain text file is one document, read in pieces of about a megabyte (each cut after a blank line),
so a file of any size streams; JSON Lines, CSV and parquet files hold a document per row (the
`data.text_field` column); a `.json` file is a list of rows (read whole: JSON arrays do not stream).
Documents that are empty or only whitespace are skipped.

Every source has a fingerprint (its files' paths, sizes and modification times; a dataset's id and
Arrow fingerprint), which names its tokenized copy in the cache (tfcli.data.store).
"""

from __future__ import annotations

import csv
import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError, listing
from .sources import _first_line, builtin_corpus_file, expand_paths, load_hub_dataset

PIECE_CHARS = 1 << 20  # a text file is read in pieces of about this many characters
TEXT_SUFFIXES = {".txt", ".text", ".md"}

Piece = tuple[str, bool]  # some text of a document, and whether the document ends with it


@dataclass(frozen=True)
class DocumentSource:
    """Where a corpus's documents are, as data.source names them."""

    spec: str
    text_field: str = "text"
    files: tuple[Path, ...] = ()
    hub: tuple[str, str | None, str] | None = None  # (name, config, split)
    streaming: bool = False

    def fingerprint(self) -> str:
        """Cheap and stable: file metadata, not contents (a changed file changes its size or mtime)."""
        if self.hub is not None:
            return hashlib.sha256(f"hf|{self.hub}|{self.text_field}".encode()).hexdigest()[:20]
        parts = [f"{f.resolve()}|{f.stat().st_size}|{f.stat().st_mtime_ns}" for f in self.files]
        return hashlib.sha256("\n".join([self.text_field, *parts]).encode()).hexdigest()[:20]

    def total_bytes(self) -> int | None:
        """The size of a corpus of plain text files (a progress bar's total); None for tables and the hub."""
        if self.hub is not None or not self.files or any(f.suffix.lower() not in TEXT_SUFFIXES for f in self.files):
            return None
        return sum(f.stat().st_size for f in self.files)

    def pieces(self) -> Iterator[Piece]:
        """Every document's text in order, as (piece, ends the document)."""
        if self.hub is not None:
            yield from _hub_rows(self)
            return
        for path in self.files:
            yield from read_file(path, self.text_field)

    def documents(self) -> Iterator[str]:
        """Whole documents (a text file's pieces joined: for samples, not for whole corpora)."""
        parts: list[str] = []
        for text, ends in self.pieces():
            parts.append(text)
            if ends:
                yield "".join(parts)
                parts = []


def open_source(spec: str, text_field: str = "text", streaming: bool = False) -> DocumentSource:
    """data.source -> DocumentSource, its files checked to exist and be of a known kind."""
    if spec.startswith("hf:"):
        name, _, rest = spec[3:].partition(":")
        config, _, split = rest.partition(":")
        return DocumentSource(spec, text_field, hub=(name, config or None, split or "train"), streaming=streaming)
    files = [builtin_corpus_file()] if spec == "builtin" else expand_paths(spec)
    return DocumentSource(spec, text_field, tuple(files), streaming=streaming)


def read_file(path: Path, field: str) -> Iterator[Piece]:
    suffix = path.suffix.lower()
    if suffix in TEXT_SUFFIXES:
        return _text_pieces(path)
    if suffix == ".jsonl":
        return _rows_as_pieces(_jsonl_rows(path), path, field)
    if suffix == ".json":
        return _rows_as_pieces(_json_rows(path), path, field)
    if suffix == ".csv":
        return _rows_as_pieces(_csv_rows(path), path, field)
    if suffix == ".parquet":
        return _rows_as_pieces(_parquet_rows(path, field), path, field)
    raise UserError(f"unsupported data file {path}")


def _text_pieces(path: Path) -> Iterator[Piece]:
    """One document: pieces of ~PIECE_CHARS, each extended to the end of a paragraph."""
    pending: str | None = None  # held back until we know whether the document ends with it
    try:
        with open(path, encoding="utf-8") as f:
            while True:
                piece = f.read(PIECE_CHARS)
                if not piece:
                    break
                while not piece.endswith("\n\n"):
                    line = f.readline()
                    if not line:
                        break
                    piece += line
                if piece.strip():
                    if pending is not None:
                        yield pending, False
                    pending = piece
    except UnicodeDecodeError as e:
        raise UserError(f"could not read {path}: not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise UserError(f"could not read {path}: {e.strerror or e}") from None
    if pending is not None:
        yield pending, True


def _rows_as_pieces(rows: Iterator[dict], path: Path, field: str) -> Iterator[Piece]:
    """Each row's `field` as one document; a missing column is named with the columns there are."""
    first = True
    for row in rows:
        if first and field not in row:
            raise UserError(f"{path}: no {field!r} field (columns: {listing(map(str, row))}); set data.text_field")
        first = False
        text = row.get(field)
        if text is not None and not isinstance(text, str):
            text = str(text)
        if text and text.strip():
            yield text, True


def _jsonl_rows(path: Path) -> Iterator[dict]:
    try:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except ValueError as e:
                    raise UserError(f"could not read {path}: line {n} is not JSON ({e.msg})") from None
                if not isinstance(row, dict):
                    raise UserError(f"could not read {path}: line {n} is not a JSON object")
                yield row
    except UnicodeDecodeError as e:
        raise UserError(f"could not read {path}: not UTF-8 text (byte {e.start})") from None


def _json_rows(path: Path) -> Iterator[dict]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError):
        yield from _jsonl_rows(path)  # JSON Lines under a .json name
        return
    rows = data.get("data", data) if isinstance(data, dict) else data
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise UserError(f"could not read {path}: expected a list of objects (or JSON Lines)")
    yield from rows


def _csv_rows(path: Path) -> Iterator[dict]:
    try:
        with open(path, encoding="utf-8", newline="") as f:
            yield from csv.DictReader(f)
    except (UnicodeDecodeError, csv.Error) as e:
        raise UserError(f"could not read {path}: {_first_line(e)}") from None


def _parquet_rows(path: Path, field: str) -> Iterator[dict]:
    import pyarrow.parquet as pq

    try:
        table = pq.ParquetFile(path)
        if field not in table.schema_arrow.names:
            raise UserError(
                f"{path}: no {field!r} field (columns: {listing(table.schema_arrow.names)}); set data.text_field"
            )
        for batch in table.iter_batches(columns=[field], batch_size=1024):
            yield from batch.to_pylist()
    except UserError:
        raise
    except Exception as e:  # not parquet, truncated
        raise UserError(f"could not read {path}: {_first_line(e)}") from None


def _hub_rows(source: DocumentSource) -> Iterator[Piece]:
    name, config, split = source.hub
    label = f"hf:{name}" + (f":{config}" if config else "")
    ds = load_hub_dataset(name, config, split, instead="use local files instead", streaming=source.streaming)
    columns = list(ds.features or {}) if getattr(ds, "features", None) else None
    if columns is not None and source.text_field not in columns:
        raise UserError(f"{label}: no {source.text_field!r} column (columns: {listing(columns)})")
    yield from _rows_as_pieces(iter(ds), Path(label), source.text_field)
