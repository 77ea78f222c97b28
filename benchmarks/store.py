"""Tokenizing a small corpus into a store: in this process, in a pool of 2 worker processes, and as
`data.workers` 0 (auto) chooses, for sources of 60k to 12M characters (War and Peace repeated, a
600-entry BPE). A pool of spawned processes costs seconds to start, more than one process takes for
a source of a batch or two (store.BATCH_CHARS each), so auto keeps those in this process
(store.POOL_MIN_BATCHES). The best of 2 runs, each into a fresh directory.

    python -m benchmarks store
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "text"
SIZES = (60_000, 2_000_000, 6_000_000, 12_000_000)


def main() -> None:
    from tfcli.data import store
    from tfcli.data.documents import open_source
    from tfcli.data.tokenizers import build_tokenizer

    novel = (SHARED / "war_and_peace.txt").read_text()
    tok = build_tokenizer(
        "bpe", vocab_size=600, path="", lowercase=False, texts=[novel[:200_000]], specials=["<|endoftext|>"]
    )
    print(f"store: seconds to tokenize (batches of {store.BATCH_CHARS:,} characters)")
    print(f"{'characters':>12} {'1 process':>10} {'2 workers':>10} {'auto':>8}")
    with tempfile.TemporaryDirectory() as tmp:
        for n in SIZES:
            path = Path(tmp) / f"{n}.txt"
            path.write_text((novel * (n // len(novel) + 1))[:n])
            source = open_source(str(path))
            seconds = []
            for workers in (1, 2, 0):
                best = float("inf")
                for attempt in range(2):
                    out = Path(tmp) / f"store-{n}-{workers}-{attempt}"
                    started = time.perf_counter()
                    store.prepare(source, tok, out, workers=workers, quiet=True)
                    best = min(best, time.perf_counter() - started)
                seconds.append(best)
            print(f"{n:>12,} {seconds[0]:>10.2f} {seconds[1]:>10.2f} {seconds[2]:>8.2f}")


if __name__ == "__main__":
    main()
