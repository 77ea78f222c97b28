"""Where data comes from: the built-in offline corpus and packaged assets, local paths (files, globs,
directories), and the Hugging Face hub (one-line errors when it cannot be reached). Reading the
documents themselves is tfcli.data.documents; labelled tables, tfcli.data.labelled.
"""

from __future__ import annotations

import ast
import glob
import json
import os
import socket
import sys
import sysconfig
from pathlib import Path
from urllib.parse import urlparse

from ..errors import UserError

DATA_SUFFIXES = (".csv", ".json", ".jsonl", ".md", ".parquet", ".text", ".txt")  # documents (tfcli.data.documents)


ASSETS = Path(__file__).resolve().parent.parent / "assets"  # files that ship inside the package


def asset(name: str) -> Path:
    """`builtin:NAME`: a data file or tokenizer directory that ships with tfcli (tfcli/assets/NAME)."""
    path = ASSETS / name
    if not name or not path.exists():
        known = ", ".join(sorted(p.name for p in ASSETS.iterdir() if p.is_dir()))
        raise UserError(f"builtin:{name}: no such built-in file (known: {known})")
    return path


def cache_dir() -> Path:
    """tfcli's own cache (built-in corpus, matmul peak); $TFCLI_CACHE overrides."""
    d = Path(os.environ.get("TFCLI_CACHE", Path.home() / ".cache" / "tfcli"))
    d.mkdir(parents=True, exist_ok=True)
    return d


def write_into_place(path: Path, write) -> None:
    """Write a cache file whole or not at all: `write(tmp)` fills a temporary file of this process's
    own, which then replaces `path` in one rename. Two processes filling the same entry at once (two
    runs, two test workers) each rename their own file; the last one wins, and both are whole."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def quiet_datasets():
    """The `datasets` module with its progress bars and log messages off: tfcli reports its own
    progress, and turns datasets' errors into one line of its own."""
    import logging

    import datasets

    datasets.disable_progress_bars()
    datasets.utils.logging.set_verbosity(logging.CRITICAL)
    return datasets


def expand_paths(source: str) -> list[Path]:
    """Files named by a comma-separated list of files, globs and directories (searched recursively)."""
    files: list[Path] = []
    for part in (p.strip() for p in source.split(",") if p.strip()):
        if part == "builtin":  # e.g. 'builtin,my/texts/': the built-in corpus plus files
            files.append(builtin_corpus_file())
        elif part.startswith("builtin:"):  # a text that ships with tfcli, e.g. builtin:tinyshakespeare
            files += sorted(f for f in asset(part[len("builtin:") :]).glob("*.txt"))
        elif any(ch in part for ch in "*?["):
            matches = sorted(Path(m) for m in glob.glob(part, recursive=True) if Path(m).is_file())
            if not matches:
                raise UserError(f"no files match {part!r}")
            files += matches
        elif Path(part).is_dir():
            found = sorted(p for p in Path(part).rglob("*") if p.is_file() and p.suffix.lower() in DATA_SUFFIXES)
            if not found:
                raise UserError(f"no data files ({', '.join(sorted(DATA_SUFFIXES))}) in directory {part}")
            files += found
        elif Path(part).is_file():
            files.append(Path(part))
        else:
            raise UserError(f"data not found: {part}")
    for f in files:
        if f.suffix.lower() not in DATA_SUFFIXES:
            raise UserError(f"unsupported data file {f} (use {', '.join(sorted(DATA_SUFFIXES))})")
    return files


def load_hub_dataset(
    name: str, config: str | None = None, split: str | None = None, *, instead: str, streaming: bool = False
):
    """`datasets.load_dataset` for a hub dataset that fails with one line, and within seconds rather
    than after a minute of retries when the hub cannot be reached. `instead` says what to do then."""
    datasets = quiet_datasets()

    label = f"{name}:{config}" if config else name
    if not hub_offline() and not hub_reachable():
        raise UserError(
            f"could not load Hugging Face dataset {label!r}: the hub is unreachable from here; "
            f"{instead} (or set HF_HUB_OFFLINE=1 to use a cached copy)"
        )
    try:
        return datasets.load_dataset(name, config, split=split, streaming=streaming)
    except Exception as e:  # unknown name, offline without a cache, ...
        raise UserError(f"could not load Hugging Face dataset {label!r} ({_first_line(e)}); {instead}") from None


def hub_offline() -> bool:
    return any(os.environ.get(v, "0") not in ("0", "") for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the Hugging Face hub (HF_ENDPOINT) accepts a TCP connection."""
    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def _first_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else e.__class__.__name__


# --- the built-in corpus ----------------------------------------------------------------------


def builtin_corpus_file() -> Path:
    """Python's own English documentation, written once to the cache as JSON Lines of documents.

    pydoc_data.topics (the language reference topics, ~465k characters) plus the docstrings of
    the standard library (~1.8M characters): real prose that ships with every Python, so the
    demo works on a machine with nothing downloaded.
    """
    path = cache_dir() / f"builtin-corpus-py{sys.version_info.major}.{sys.version_info.minor}.jsonl"
    if not path.exists():
        docs = list(_pydoc_topics()) + list(_stdlib_docstrings())
        text = "".join(json.dumps({"text": d}) + "\n" for d in docs)
        write_into_place(path, lambda tmp: tmp.write_text(text))  # a crash never leaves half a corpus
    return path


def builtin_documents() -> list[str]:
    return [json.loads(line)["text"] for line in builtin_corpus_file().read_text().splitlines()]


def _pydoc_topics():
    from pydoc_data.topics import topics

    for name in sorted(topics):
        yield topics[name].strip()


def _stdlib_docstrings():
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idlelib", "lib2to3", "site-packages", "turtledemo", "ensurepip"}
    for path in sorted(stdlib.rglob("*.py")):
        if skip & set(path.relative_to(stdlib).parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        nodes = [tree] + [
            n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        ]
        parts = [d.strip() for d in (ast.get_docstring(n) for n in nodes) if d and len(d.strip()) > 40]
        if parts:
            yield "\n\n".join(parts)
