"""KTO, ORPO and SimPO (issue 73) learning on SmolLM2-135M-Instruct (its GGUF) and Anthropic HH
harmless pairs: the held-out reward margin (chosen - rejected reward, TRL's `rewards/margins`) before
and after, on the first BENCH_PREF_HELD (120) of the last 300 pairs of the file, which no run trained on, and whether the model still
answers "The capital of France is" with Paris (greedy).

Each method: LoRA r16 on every block linear, BENCH_PREF_STEPS (32) steps x 8 rows (KTO: 8 unpaired
rows, each pair split in two; ORPO and SimPO: 8 pairs), lr 1e-4, the recipes' other settings (TRL's:
beta 0.1, simpo_gamma 0.5), the first TRAIN kept pairs to train on. The margin before: KTO's rewards
are log-ratios to the model itself, 0 by construction; ORPO's and SimPO's are the model's own
(length-normalised) log-probabilities, measured on the base file with the same loss.

BENCH_PREF_METHODS=kto,orpo,simpo picks methods; BENCH_PREF_RUNS=DIR keeps the runs there (a second
call reuses finished runs and evaluations). Quality figures: nothing here is timed.

    python -m benchmarks preference_learning
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from benchmarks.reward_model import BATCH, split_files, tfcli
from benchmarks.sft import SEED
from benchmarks.smollm2 import gguf_file
from benchmarks.trl_peer import missing

STEPS = int(os.environ.get("BENCH_PREF_STEPS", 32))
HELD = int(os.environ.get("BENCH_PREF_HELD", 120))
LR = 1e-4
PARIS = "The capital of France is"
METHODS = {  # method -> (tfcli task, its settings)
    "kto": ("kto", []),
    "orpo": ("dpo", ["dpo.loss=orpo"]),
    "simpo": ("dpo", ["dpo.loss=simpo"]),
}


def settings(method: str) -> list[str]:
    return [a for s in METHODS[method][1] for a in ("--set", s)]


def trained(method: str, data: Path, runs: Path) -> Path:
    run = runs / method
    if not (run / "eval.json").is_file():
        task = METHODS[method][0]
        args = ["finetune", task, "--from", str(gguf_file()), "--data", str(data), "--train", "lora"]
        args += ["--steps", str(STEPS), "--batch-size", str(BATCH), "--lr", str(LR), "--seed", str(SEED), "--quiet"]
        args += ["--set", "train.threads=2", "--set", f"train.eval_interval={max(1, STEPS // 2)}"]
        args += ["--set", "data.val_fraction=0.03", "--set", "finetune.warmup_fraction=0.1"]
        tfcli(*args, *settings(method), out=run)
    return run


def evaluated(method: str, checkpoint: Path, held: Path, out: Path) -> dict:
    """The held-out report of `tfcli eval` (its one split), written once to `out`."""
    if not out.is_file():
        args = ["eval", METHODS[method][0], "--checkpoint", str(checkpoint), "--data", str(held), "--limit"]
        args.append(str(HELD * (2 if method == "kto" else 1)))  # a KTO row is half a pair
        tfcli(*args, *settings(method), "--out", str(out), "--quiet")
    return next(v for v in json.loads(out.read_text()).values() if isinstance(v, dict))


def dev_margins(run: Path) -> list[tuple[int, float]]:
    """(step, rewards/margins) of each evaluation on the run's own dev split during training."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [(m["step"], m["rewards/margins"]) for m in rows if m.get("split") == "val" and "rewards/margins" in m]


def paris(checkpoint: Path) -> str:
    out = tfcli("generate", "--checkpoint", str(checkpoint), "--greedy", "--max-new-tokens", "8", "--prompt", PARIS)
    return " ".join(out.split())


def learn(method: str, train: Path, held: Path, runs: Path) -> None:
    run = trained(method, train, runs)
    after = evaluated(method, run, held, runs / f"held-{method}.json")
    if method == "kto":
        before = 0.0  # the policy is its own reference before a step
    else:
        before = evaluated(method, gguf_file(), held, runs / f"held-{method}-base.json")["rewards/margins"]
    dev = ", ".join(f"{m:.3f} at {s}" for s, m in dev_margins(run))
    picked = Path(json.loads((runs / f"held-{method}.json").read_text())["checkpoint"]).name  # the run's best
    print(
        f"{method} (LoRA, {STEPS} steps x {BATCH}, lr {LR:g}): held-out margin {before:.3f} before, "
        f"{after['rewards/margins']:.3f} after ({picked}, the checkpoint the run picked by its dev loss) "
        f"on {after['n']} {('rows' if method == 'kto' else 'pairs')} "
        f"never trained on; dev margins {dev}; '{PARIS}' -> {paris(run)!r}"
    )


def main() -> None:
    if why := missing("preference_learning"):
        print(why)
        return
    methods = os.environ.get("BENCH_PREF_METHODS", ",".join(METHODS)).split(",")
    with tempfile.TemporaryDirectory() as scratch:
        runs = Path(os.environ.get("BENCH_PREF_RUNS") or scratch)
        runs.mkdir(parents=True, exist_ok=True)
        train, held = split_files(runs)
        print(f"base: '{PARIS}' -> {paris(gguf_file())!r}")
        for method in methods:
            learn(method, train, held, runs)


if __name__ == "__main__":
    main()
