"""`make bench-data`: corpora larger than memory. For text corpora of 20 MB, 200 MB and 2 GB (the
shared texts cut into documents and repeated), it reports `tfcli prepare` with 1 and 2 worker
processes (seconds, tokens/s), the store's size on disk, and the peak RSS of a 50-step gpt-mini run
on the store, as the training process itself reports it (peak_mem_mb in metrics.jsonl).

Targets (issue 12): the training process's peak RSS grows by less than 10% from 20 MB to 2 GB;
2 workers tokenize at least 1.7x as fast as 1. GPT-2's tokenizer; every process one thread.

    python -m benchmarks data            # all three sizes (about 30 minutes on 2 cores)
    BENCH_DATA_SIZES=20,200 python -m benchmarks data
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import RESULTS

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "text"
TEXTS = ["war_and_peace.txt", "sherlock_holmes_complete.txt", "tinyshakespeare.txt"]
DOC_CHARS = 20_000  # documents of about this size, as web text has


def documents() -> list[str]:
    text = "\n\n".join((SHARED / name).read_text() for name in TEXTS)
    return [text[i : i + DOC_CHARS] for i in range(0, len(text), DOC_CHARS)]


def write_corpus(path: Path, megabytes: int) -> Path:
    """JSON Lines of documents, the shared texts repeated until the file is `megabytes` MB."""
    if path.is_file() and path.stat().st_size >= megabytes * 10**6:
        return path
    docs = [json.dumps({"text": d}) + "\n" for d in documents()]
    written = 0
    with open(path, "w") as f:
        while written < megabytes * 10**6:
            for d in docs:
                f.write(d)
                written += len(d)
                if written >= megabytes * 10**6:
                    break
    return path


def tfcli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    result = subprocess.run([sys.executable, "-m", "tfcli", *args], capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise SystemExit(f"tfcli {' '.join(args)} failed:\n{result.stdout[-2000:]}{result.stderr[-2000:]}")
    return result


def prepare(corpus: Path, out: Path, workers: int) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    tfcli(
        "prepare", "--data", str(corpus), "--tokenizer", "gpt2", "--out", str(out), "--workers", str(workers), "--quiet"
    )
    seconds = time.perf_counter() - t0
    index = json.loads((out / "index.json").read_text())
    size = sum(f.stat().st_size for f in out.iterdir())
    return {
        "seconds": round(seconds, 1),
        "tokens": index["tokens"],
        "tok_per_s": round(index["tokens"] / seconds),
        "disk_mb": round(size / 1e6, 1),
    }


def train_rss(store: Path, run: Path) -> float:
    """Peak RSS (MB) of a 50-step gpt-mini run on the store, as the run logs it."""
    shutil.rmtree(run, ignore_errors=True)
    tfcli(
        "pretrain",
        "--recipe",
        "gpt-mini",
        "--data",
        str(store),
        "--steps",
        "50",
        "--out",
        str(run),
        "--quiet",
        "--set",
        "train.eval_interval=50",
        "--set",
        "train.ckpt_interval=50",
        "--set",
        "train.eval_batches=2",
        "--set",
        "train.threads=2",
    )
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return max(r.get("peak_mem_mb", 0) for r in rows)


def main() -> None:
    sizes = [int(s) for s in os.environ.get("BENCH_DATA_SIZES", "20,200,2000").split(",")]
    work = Path(os.environ.get("BENCH_DATA_DIR", "/tmp/tfcli-bench-data"))
    work.mkdir(parents=True, exist_ok=True)
    results = []
    for mb in sizes:
        corpus = write_corpus(work / f"corpus-{mb}mb.jsonl", mb)
        one = prepare(corpus, work / f"store-{mb}-w1", workers=1)
        two = prepare(corpus, work / f"store-{mb}-w2", workers=2)
        shutil.rmtree(work / f"store-{mb}-w1")
        rss = train_rss(work / f"store-{mb}-w2", work / f"run-{mb}")
        row = {
            "corpus_mb": mb,
            "tokens": two["tokens"],
            "prepare_1_worker_s": one["seconds"],
            "prepare_2_workers_s": two["seconds"],
            "tok_per_s_1": one["tok_per_s"],
            "tok_per_s_2": two["tok_per_s"],
            "speedup": round(two["tok_per_s"] / one["tok_per_s"], 2),
            "disk_mb": two["disk_mb"],
            "train_peak_rss_mb": round(rss, 1),
        }
        results.append(row)
        print(
            f"{mb:>5} MB: {row['tokens']:,} tokens; prepare 1 worker {one['seconds']} s ({one['tok_per_s']:,} tok/s), "
            f"2 workers {two['seconds']} s ({two['tok_per_s']:,} tok/s, {row['speedup']}x); "
            f"store {row['disk_mb']} MB; 50-step gpt-mini peak RSS {row['train_peak_rss_mb']} MB",
            flush=True,
        )
        shutil.rmtree(work / f"store-{mb}-w2")
        shutil.rmtree(work / f"run-{mb}", ignore_errors=True)
    if len(results) > 1:
        growth = results[-1]["train_peak_rss_mb"] / results[0]["train_peak_rss_mb"] - 1
        speedups = [r["speedup"] for r in results]
        print(
            f"peak RSS grows {100 * growth:+.1f}% from {results[0]['corpus_mb']} MB to {results[-1]['corpus_mb']} MB "
            f"({'meets' if growth < 0.10 else 'MISSES'} the <10% target); 2-worker speedup "
            f"{min(speedups)}-{max(speedups)}x ({'meets' if min(speedups) >= 1.7 else 'MISSES'} the 1.7x target)"
        )
    RESULTS.mkdir(exist_ok=True)
    with open(RESULTS / "results.jsonl", "a") as f:
        for r in results:
            f.write(json.dumps({"benchmark": "data", **r}) + "\n")
