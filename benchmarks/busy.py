"""Training on a busy machine: gpt-mini steps while another job keeps every core busy, with tfcli's
thread choice (train.threads=0: the usable cores less those other work keeps busy) against one
thread per core (torch's default, and tfcli's before it looked).

The other job is one spinning process per core, started before and stopped after each contender;
each contender is a whole `tfcli pretrain` in a fresh process, timed from its log lines (set-up and
the final checkpoint left out), alternating twice. Two jobs on the same cores is the point here, so
unlike every other benchmark this one must not run beside anything else either.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import RESULTS, ROOT

STEPS, LOG_EVERY = 60, 20


def spin(stop) -> None:
    """A CPU-bound job: the machine's other user."""
    x = 0
    while not stop.is_set():
        x = (x * 1103515245 + 12345) % 2**31


def seconds_per_step(threads: int, work: Path, text: Path) -> tuple[float, int]:
    """(seconds per step, threads the run used) of a fresh `tfcli pretrain --recipe gpt-mini` process."""
    out = work / f"t{threads}-{time.monotonic_ns()}"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run(
        [
            sys.executable,
            "-m",
            "tfcli",
            "pretrain",
            "--recipe",
            "gpt-mini",
            "--data",
            str(text),
            "--steps",
            str(STEPS),
            "--out",
            str(out),
            "--quiet",
            "--set",
            f"train.threads={threads}",
            "--set",
            f"train.log_interval={LOG_EVERY}",
            "--set",
            f"train.eval_interval={STEPS}",
            "--set",
            f"train.ckpt_interval={STEPS}",
            "--set",
            "train.device=cpu",
            "--set",
            "tokenizer.train_chars=300000",
        ],
        check=True,
        env=env,
        capture_output=True,
    )
    logs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    logs = [m for m in logs if m.get("split") == "train"]
    meta = json.loads(next((out / "checkpoints").glob("step-*/meta.json")).read_text())
    return (logs[-1]["elapsed_s"] - logs[0]["elapsed_s"]) / (logs[-1]["step"] - logs[0]["step"]), meta["threads"]


def main() -> None:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        text = work / "text.txt"
        text.write_text((ROOT / "tfcli" / "assets" / "tinyshakespeare" / "input.txt").read_text()[:400_000])
        seconds_per_step(1, work, text)  # tokenizer and token store cached before timing
        times: dict[str, list[float]] = {"tfcli's choice": [], f"{cores} threads": []}
        chosen = []
        ctx = multiprocessing.get_context("spawn")
        for _ in range(2):
            for name, threads in (("tfcli's choice", 0), (f"{cores} threads", cores)):
                stop = ctx.Event()
                hogs = [ctx.Process(target=spin, args=(stop,), daemon=True) for _ in range(cores)]
                for h in hogs:
                    h.start()
                time.sleep(1.5)  # the hogs are on the cores when tfcli looks
                try:
                    s, used = seconds_per_step(threads, work, text)
                finally:
                    stop.set()
                    for h in hogs:
                        h.join()
                times[name].append(s)
                if threads == 0:
                    chosen.append(used)
    med = {k: statistics.median(v) for k, v in times.items()}
    ours, default = med["tfcli's choice"], med[f"{cores} threads"]
    print(
        f"busy machine, gpt-mini beside {cores} spinning processes: tfcli's choice ({chosen} threads) "
        f"{1e3 * ours:.0f} ms/step, {cores} threads {1e3 * default:.0f} ms/step: {default / ours:.2f}x"
    )
    RESULTS.mkdir(exist_ok=True)
    with open(RESULTS / "results.jsonl", "a") as f:
        f.write(
            json.dumps(
                {
                    "benchmark": "busy machine (gpt-mini)",
                    "unit": "s/step",
                    "chosen_threads": chosen,
                    **{k: round(v, 4) for k, v in med.items()},
                    "ratio": round(default / ours, 3),
                }
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
