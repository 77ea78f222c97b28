"""Distillation (issue 73, part 5) learning: a 135M student distilled from a stronger teacher on 2-digit
addition, on-policy against off-policy at the same budget, scored on held-out prompts it never saw.

  teacher    SmolLM2-135M-Instruct (its GGUF) GRPO-trained by tfcli on "What is A + B?" (reward
             final-number; LoRA r16, lr 1e-4, 4 prompts x 8 completions of at most 64 tokens at
             temperature 0.7, BENCH_DISTILL_TEACHER_STEPS = 40 steps), or BENCH_DISTILL_TEACHER=RUN.
  on-policy  `finetune distill --teacher TEACHER` from the base GGUF: the student samples its own
             completions and the teacher scores every token (reverse KL, TRL's default), lmbda 1.
  off-policy the same, lmbda 0: every step on the data's replies, which are the teacher's own greedy
             replies to the same training prompts (written once by `tfcli eval grpo`), the teacher
             scoring every token of them.
  both       LoRA r16, lr 1e-4, BENCH_DISTILL_STEPS (32) steps x 8 prompts drawn from the same pool
             (the first 32 x 8 training prompts: an epoch); held-out: the first BENCH_DISTILL_HELD (200) of
             500 prompts drawn apart (seed 2), greedy, at most 64 tokens, reward = the final number is
             the sum (`tfcli eval grpo`).

The report: the held-out accuracy of the base (the student before), the teacher, each student, and the
share of the gap between base and teacher that each student closed. BENCH_DISTILL_SEEDS (1337) lists the
students' seeds (comma-separated: each a pair of students, their LoRA's initial weights, their prompts'
order and their samples drawn apart; the teacher and its replies are the same for all), and the report
adds each student's mean over them and, paired over the seeds, off-policy minus on-policy.
BENCH_DISTILL_RUNS=DIR keeps the runs (a second call reuses what is finished). Quality figures only:
nothing here is timed.

    python -m benchmarks distill_learning
"""

from __future__ import annotations

import json
import os
import random
import tempfile
from pathlib import Path

from benchmarks.reward_model import tfcli
from benchmarks.smollm2 import gguf_file
from benchmarks.trl_peer import missing

TEACHER_STEPS = int(os.environ.get("BENCH_DISTILL_TEACHER_STEPS", 40))
STEPS = int(os.environ.get("BENCH_DISTILL_STEPS", 32))
HELD = int(os.environ.get("BENCH_DISTILL_HELD", 200))
BATCH, LIMIT, LR, SEED = 8, 64, 1e-4, 1337
SEEDS = [int(s) for s in os.environ.get("BENCH_DISTILL_SEEDS", str(SEED)).split(",")]
THREADS = int(os.environ.get("BENCH_THREADS", 2))  # of each run (1: beside another job)
COMMON = ["--set", f"train.threads={THREADS}", "--set", "data.seq_len=128", "--set", "train.eval_interval=1000"]


def addition(path: Path, n: int, seed: int) -> Path:
    if not path.is_file():
        r = random.Random(seed)
        rows = [(r.randint(10, 99), r.randint(10, 99)) for _ in range(n)]
        lines = [json.dumps({"prompt": f"What is {a} + {b}?", "answer": str(a + b)}) + "\n" for a, b in rows]
        path.write_text("".join(lines))
    return path


def teacher(train: Path, runs: Path) -> Path:
    if given := os.environ.get("BENCH_DISTILL_TEACHER"):
        return Path(given)
    run = runs / "teacher"
    if not (run / "eval.json").is_file():
        args = ["finetune", "grpo", "--from", str(gguf_file()), "--data", str(train), "--reward", "final-number"]
        args += ["--train", "lora", "--steps", str(TEACHER_STEPS), "--batch-size", "4", "--lr", str(LR)]
        args += ["--seed", str(SEED), "--quiet", "--set", "grpo.num_generations=8", "--set", "grpo.eval_prompts=0"]
        args += ["--set", f"grpo.max_completion_length={LIMIT}", "--set", "grpo.temperature=0.7", *COMMON]
        args += ["--set", "finetune.report_limit=1"]
        tfcli(*args, out=run)
    return run


def accuracy(checkpoint: Path, data: Path, out: Path, limit: int = HELD) -> dict:
    """`tfcli eval grpo` of `checkpoint` on the first `limit` prompts of `data` (greedy): its report."""
    if not out.is_file():
        args = ["eval", "grpo", "--checkpoint", str(checkpoint), "--data", str(data), "--limit", str(limit)]
        args += ["--reward", "final-number", "--set", f"grpo.max_completion_length={LIMIT}", "--quiet"]
        tfcli(*args, "--out", str(out))
    return next(v for v in json.loads(out.read_text()).values() if isinstance(v, dict))


def student_data(teacher_run: Path, train: Path, runs: Path) -> tuple[Path, Path]:
    """The prompts the students draw from (as many as a run draws: an epoch), and the same prompts each with
    the teacher's greedy reply (the off-policy data)."""
    rows, prompts = runs / "replies.jsonl", runs / "train-prompts.jsonl"
    if not rows.is_file():
        prompts.write_text("".join(train.read_text().splitlines(keepends=True)[: STEPS * BATCH]))
        accuracy(teacher_run, prompts, runs / "teacher-train.json", STEPS * BATCH)
        samples = runs / "teacher-train-samples.jsonl"  # written beside the report
        lines = [json.loads(x) for x in samples.read_text().splitlines()]
        rows.write_text("".join(json.dumps({"prompt": q["prompt"], "completion": reply(q)}) + "\n" for q in lines))
    return prompts, rows


def reply(line: dict) -> str:
    """A samples line's completion text (the assistant's reply)."""
    completion = line["completion"]
    return completion if isinstance(completion, str) else completion[-1]["content"]


def student(name: str, lmbda: float, data: Path, teacher_run: Path, runs: Path, seed: int = SEED) -> Path:
    run = runs / name
    if not (run / "eval.json").is_file():
        args = ["finetune", "distill", "--from", str(gguf_file()), "--teacher", str(teacher_run), "--data", str(data)]
        args += ["--train", "lora", "--steps", str(STEPS), "--batch-size", str(BATCH), "--lr", str(LR)]
        args += ["--seed", str(seed), "--quiet", "--set", f"distill.lmbda={lmbda}", *COMMON]
        args += ["--set", f"distill.max_completion_length={LIMIT}", "--set", "finetune.report_limit=8"]
        tfcli(*args, out=run)
    return run


def main() -> None:
    if why := missing("distill_learning"):
        print(why)
        return
    with tempfile.TemporaryDirectory() as scratch:
        runs = Path(os.environ.get("BENCH_DISTILL_RUNS") or scratch)
        runs.mkdir(parents=True, exist_ok=True)
        train = addition(runs / "train.jsonl", 4000, 1)
        held = addition(runs / "held.jsonl", 500, 2)
        base = accuracy(gguf_file(), held, runs / "held-base.json")["reward"]
        strong = teacher(train, runs)
        top = accuracy(strong, held, runs / "held-teacher.json")["reward"]
        print(f"held-out accuracy ({HELD} prompts, greedy): student before {base:.3f}, teacher {top:.3f}")
        prompts, replies = student_data(strong, train, runs)
        got: dict[str, list[float]] = {"on-policy": [], "off-policy": []}
        for seed in SEEDS:
            for name, lmbda, data in (("on-policy", 1.0, prompts), ("off-policy", 0.0, replies)):
                label = name if seed == SEED else f"{name}-seed{seed}"  # the first sitting's names kept
                run = student(label, lmbda, data, strong, runs, seed)
                got[name].append(accuracy(run, held, runs / f"held-{label}.json")["reward"])
                print(
                    f"{name} student (LoRA, {STEPS} steps x {BATCH} prompts, lmbda {lmbda:g}, seed {seed}): "
                    f"{got[name][-1]:.3f}, {100 * closed(got[name][-1], base, top):.0f}% of the gap closed"
                )
        for name, scores in got.items():
            mean = sum(scores) / len(scores)
            print(f"{name}, mean of {len(scores)} seeds: {mean:.3f}, {100 * closed(mean, base, top):.0f}% of the gap")
        gaps = [off - on for on, off in zip(got["on-policy"], got["off-policy"])]
        print("off-policy minus on-policy, seed by seed: " + ", ".join(f"{g:+.3f}" for g in gaps))


def closed(score: float, base: float, top: float) -> float:
    """The share of the base-to-teacher gap a student's held-out accuracy closed."""
    return (score - base) / (top - base) if top != base else float("nan")


if __name__ == "__main__":
    main()
