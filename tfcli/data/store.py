"""Tokenized corpora on disk: tokenized once, in worker processes, then read by every run.

A store is a directory:
    tokens.bin      every document's ids end to end (uint16 when the vocabulary fits, else uint32)
    docs.bin        int64 end offset of each document in tokens.bin
    sents.bin       int64 end offset of each sentence (sentence stores, for BERT's segment pairs)
    doc_sents.bin   int64 number of sentences up to the end of each document (sentence stores)
    tokenizer.json  the tokenizer that made it
    index.json      format, counts, dtype, what the ids mean
Documents stream from their source through a bounded window of batches, so neither tokenizing
nor training ever holds the corpus in memory: training reads the blocks of a batch from
tokens.bin with pread (DiskArray), and memory-maps only the boundary offsets it binary-searches.
Stores made for a run live in the cache, named by the source's fingerprint and the tokenizer's
(the same data and tokenizer are never tokenized twice); `tfcli prepare` writes one anywhere, and
`--data` accepts it.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import multiprocessing
import os
import shutil
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..display import console, phase
from ..errors import UserError
from . import tokenize_worker
from .documents import DocumentSource, Piece
from .sources import cache_dir
from .tokenizers import TextTokenizer

FORMAT = "tfcli-tokens/1"
INDEX = "index.json"
BATCH_CHARS = 1 << 21  # characters of text per task sent to a worker
# batches a source must hold before `workers` 0 (auto) starts processes for it: starting a pool of 2
# costs up to 2 s (0.8 s in a fresh `tfcli prepare`), about what one process takes to tokenize a
# batch or two (python -m benchmarks store)
POOL_MIN_BATCHES = 3
MODES = ("text", "sentences", "paragraphs")  # what a segment is (tokenize_worker.segments)


class DiskArray:
    """A 1-D array in a file, read a slice at a time with pread. Not a memory map on purpose: the
    page-cache pages of a mapped file count towards the process's RSS, and a kernel that caches
    files in large folios maps up to megabytes per randomly read block, so a mapped corpus's
    training RSS would grow with the corpus. A slice is a copy of just those values."""

    def __init__(self, path: Path, dtype, n: int, start: int = 0, file=None):
        self.path, self.dtype, self.n, self.start = Path(path), np.dtype(dtype), n, start
        self._file = file or open(self.path, "rb", buffering=0)

    def __len__(self) -> int:
        return self.n

    def view(self, start: int, stop: int) -> DiskArray:
        """Values [start, stop) as a DiskArray on the same open file (nothing read)."""
        start, stop, _ = slice(start, stop).indices(self.n)
        return DiskArray(self.path, self.dtype, max(0, stop - start), self.start + start, self._file)

    def __getitem__(self, key) -> np.ndarray:
        if isinstance(key, (int, np.integer)):
            i = int(key) + (self.n if key < 0 else 0)
            if not 0 <= i < self.n:
                raise IndexError(f"index {int(key)} out of range for {self.n} values")
            return self[i : i + 1][0]
        start, stop, step = key.indices(self.n)
        if step != 1:
            raise IndexError("a DiskArray reads contiguous slices only")
        count, size = max(0, stop - start), self.dtype.itemsize
        raw = os.pread(self._file.fileno(), count * size, (self.start + start) * size)
        if len(raw) != count * size:
            raise UserError(f"{self.path}: truncated while reading; prepare the data again")
        return np.frombuffer(raw, dtype=self.dtype)  # (count,) read-only

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_file"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._file = open(self.path, "rb", buffering=0)


@dataclass
class TokenStore:
    """A store opened for reading: tokens read per slice from disk, offsets memory-mapped."""

    root: Path
    tokens: DiskArray  # (N,) uint16 | uint32
    doc_ends: np.ndarray  # (D,) int64
    sent_ends: np.ndarray | None  # (S,) int64, sentence stores only
    doc_sents: np.ndarray | None  # (D,) int64, sentence stores only
    index: dict

    @classmethod
    def open(cls, root: Path) -> TokenStore:
        root = Path(root)
        try:
            index = json.loads((root / INDEX).read_text())
        except (OSError, ValueError) as e:
            raise UserError(f"{root}: not a prepared token store ({e.__class__.__name__})") from None
        if index.get("format") != FORMAT:
            raise UserError(f"{root}: a token store of format {index.get('format')!r}; this tfcli reads {FORMAT}")

        def checked(name: str, dtype, n: int) -> Path:
            path = root / name
            if not path.is_file() or path.stat().st_size != n * np.dtype(dtype).itemsize:
                raise UserError(f"{path}: missing or truncated (expected {n:,} values); prepare the data again")
            return path

        def mapped(name: str, dtype, n: int) -> np.ndarray:
            return np.memmap(checked(name, dtype, n), dtype=dtype, mode="r", shape=(n,)) if n else np.zeros(0, dtype)

        sentences = index["mode"] != "text"
        return cls(
            root,
            DiskArray(checked("tokens.bin", index["dtype"], index["tokens"]), index["dtype"], index["tokens"]),
            mapped("docs.bin", np.int64, index["documents"]),
            mapped("sents.bin", np.int64, index["sentences"]) if sentences else None,
            mapped("doc_sents.bin", np.int64, index["documents"]) if sentences else None,
            index,
        )

    def __len__(self) -> int:
        return int(self.index["tokens"])

    @property
    def n_docs(self) -> int:
        return int(self.index["documents"])

    def tokenizer_fingerprint(self) -> str:
        return self.index["tokenizer"]


def is_store(path: str) -> bool:
    """Whether data.source names a prepared store (a directory with a tfcli index.json)."""
    index = Path(path) / INDEX
    if not index.is_file():
        return False
    try:
        return json.loads(index.read_text()).get("format", "").startswith("tfcli-tokens/")
    except (OSError, ValueError):
        return False


def cached_store(
    source: DocumentSource,
    tokenizer: TextTokenizer,
    *,
    mode: str = "text",
    eos: bool = True,
    workers: int = 0,
    quiet: bool = False,
) -> TokenStore:
    """The store of `source` tokenized by `tokenizer` from the cache, made now if it is not there."""
    eos_id = tokenizer.eos_id if eos and tokenizer.eos_id is not None else -1
    key = hashlib.sha256(f"{FORMAT}|{source.fingerprint()}|{tokenizer.fingerprint()}|{mode}|{eos_id}".encode())
    root = cache_dir() / "tokens" / key.hexdigest()[:20]
    if (root / INDEX).is_file():
        return TokenStore.open(root)
    return prepare(source, tokenizer, root, mode=mode, eos=eos, workers=workers, quiet=quiet)


def default_workers() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def prepare(
    source: DocumentSource,
    tokenizer: TextTokenizer,
    out: Path,
    *,
    mode: str = "text",
    eos: bool = True,
    workers: int = 0,
    quiet: bool = False,
) -> TokenStore:
    """Tokenize every document of `source` into a store at `out` (written to a temporary directory
    first and moved into place whole: an interrupted prepare leaves nothing behind)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    eos_id = tokenizer.eos_id if eos and tokenizer.eos_id is not None and mode == "text" else -1
    dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32
    started = time.perf_counter()
    try:
        with phase(f"tokenizing {source.spec}", source.total_bytes(), "bytes") as advance:
            counts = _write(source, tokenizer, tmp, mode, eos_id, dtype, workers, advance)
        if counts["tokens"] == 0:
            raise UserError(f"{source.spec}: no text (every document is empty)")
        tokenizer.save(tmp)
        index = {
            "format": FORMAT,
            "mode": mode,
            "dtype": np.dtype(dtype).name,
            "eos": eos_id,
            "tokenizer": tokenizer.fingerprint(),
            "vocab_size": tokenizer.vocab_size,
            "source": source.spec,
            "source_fingerprint": source.fingerprint(),
            **counts,
            "seconds": round(time.perf_counter() - started, 2),
        }
        (tmp / INDEX).write_text(json.dumps(index, indent=1))
        if out.exists():  # another process finished the same store first
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    store = TokenStore.open(out)
    if not quiet:
        console.print(
            f"tokenized {source.spec}: {len(store):,} tokens in {store.n_docs:,} documents, "
            f"{store.index['seconds']:.1f} s, stored in {out}"
        )
    return store


def _batches(pieces: Iterator[Piece]) -> Iterator[list[Piece]]:
    batch, size = [], 0
    for piece in pieces:
        batch.append(piece)
        size += len(piece[0])
        if size >= BATCH_CHARS:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _results(source: DocumentSource, tokenizer: TextTokenizer, mode: str, eos_id: int, workers: int, advance):
    """Encoded batches in order: in `workers` processes (a window of 2 batches each in flight, so
    memory stays bounded), or in this process for one worker; advance(chars) as each is handed out.
    `workers` 0: a process per core (default_workers) for a source of POOL_MIN_BATCHES batches or
    more, this process for a smaller one."""
    init = (tokenizer.tok.to_str(), eos_id, mode)
    batches = _counted(_batches(source.pieces()), advance)
    if workers == 0:
        first = list(itertools.islice(batches, POOL_MIN_BATCHES))
        workers = default_workers() if len(first) == POOL_MIN_BATCHES else 1
        batches = itertools.chain(first, batches)
    if workers <= 1:
        previous = os.environ.get("TOKENIZERS_PARALLELISM")
        tokenize_worker.start(*init)  # one thread, as each worker process has
        try:
            yield from map(tokenize_worker.encode, batches)
        finally:
            if previous is None:
                os.environ.pop("TOKENIZERS_PARALLELISM", None)
            else:
                os.environ["TOKENIZERS_PARALLELISM"] = previous
        return
    with multiprocessing.get_context("spawn").Pool(workers, tokenize_worker.start, init) as pool:
        pending: deque = deque()
        for batch in batches:
            pending.append(pool.apply_async(tokenize_worker.encode, (batch,)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


def _counted(batches: Iterator[list[Piece]], advance) -> Iterator[list[Piece]]:
    """The batches, reporting each one's characters (about its bytes in a text file) to the progress bar."""
    for batch in batches:
        advance(sum(len(p[0].encode()) for p in batch))
        yield batch


def _write(
    source: DocumentSource,
    tokenizer: TextTokenizer,
    root: Path,
    mode: str,
    eos_id: int,
    dtype,
    workers: int,
    advance=lambda n: None,
) -> dict:
    """Append every encoded batch to the store's files; return the counts."""
    n_tokens = n_sents = 0
    n_docs = 0
    open_doc = False  # the last document has tokens but has not ended yet
    with (
        open(root / "tokens.bin", "wb") as tokens,
        open(root / "docs.bin", "wb") as docs,
        open(root / "sents.bin", "wb") as sents,
        open(root / "doc_sents.bin", "wb") as doc_sents,
    ):
        for ids, lengths, ends in _results(source, tokenizer, mode, eos_id, workers, advance):
            tokens.write(ids.astype(dtype, copy=False).tobytes())
            seg_ends = n_tokens + np.cumsum(lengths)  # (segments,)
            kept = lengths > 0
            sent_count = n_sents + np.cumsum(kept)
            has_tokens = _documents_with_tokens(kept, ends, open_doc)
            closing = ends & has_tokens  # documents that end here and are not empty
            docs.write(seg_ends[closing].astype(np.int64).tobytes())
            if mode != "text":
                sents.write(seg_ends[kept].astype(np.int64).tobytes())
                doc_sents.write(sent_count[closing].astype(np.int64).tobytes())
            n_tokens += int(lengths.sum())
            n_sents += int(kept.sum())
            n_docs += int(closing.sum())
            if len(ends):
                open_doc = bool(has_tokens[-1]) and not bool(ends[-1])
    if open_doc:  # a source that stopped inside a document: close it
        with open(root / "docs.bin", "ab") as docs:
            docs.write(np.array([n_tokens], dtype=np.int64).tobytes())
        if mode != "text":
            with open(root / "doc_sents.bin", "ab") as doc_sents:
                doc_sents.write(np.array([n_sents], dtype=np.int64).tobytes())
        n_docs += 1
    return {"tokens": n_tokens, "documents": n_docs, "sentences": n_sents if mode != "text" else 0}


def _documents_with_tokens(kept: np.ndarray, ends: np.ndarray, open_doc: bool) -> np.ndarray:
    """(segments,) -> whether each segment's document has had a token by the segment's end (a
    document that is still open from the last batch has, when `open_doc`)."""
    counted = np.cumsum(kept)  # tokens-bearing segments so far
    doc = np.cumsum(ends) - ends  # the document (within this batch) each segment belongs to
    before = np.concatenate([[0], counted[np.flatnonzero(ends)]])  # counted before each document
    return ((counted - before[doc]) > 0) | ((doc == 0) & open_doc)
