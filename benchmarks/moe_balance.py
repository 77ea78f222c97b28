"""Is balance learned? The moe-mini recipe (8 experts a layer, top 2) pretrained on the built-in corpus
with the load-balancing loss at several weights (0: none), the same seed and steps; at each held-out
evaluation, every layer's busiest expert over the mean (1: balanced, 8: one expert takes every token)
and the held-out loss. Draws docs/img/moe-balance.png and prints the table of the results page.

    python -m benchmarks moe_balance
    BENCH_MOE_BALANCE_DIR=/tmp/bal BENCH_MOE_BALANCE_STEPS=400 python -m benchmarks moe_balance

Runs already in the directory (aux-<weight>) are read, not trained again.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import ROOT

WEIGHTS = [float(w) for w in os.environ.get("BENCH_MOE_BALANCE_WEIGHTS", "0.0,0.01,0.1").split(",")]
STEPS = int(os.environ.get("BENCH_MOE_BALANCE_STEPS", 400))
DIRECTORY = Path(os.environ.get("BENCH_MOE_BALANCE_DIR", Path(tempfile.gettempdir()) / "tfcli-moe-balance"))
FIGURE = ROOT / "docs" / "img" / "moe-balance.png"


def run(weight: float) -> Path:
    out = DIRECTORY / f"aux-{weight}"
    if not (out / "metrics.jsonl").is_file():
        args = ["pretrain", "--objective", "clm", "--recipe", "moe-mini", "--steps", str(STEPS), "--out", str(out)]
        args += ["--set", f"model.router_aux_coef={weight}", "--set", "train.eval_interval=50", "--quiet"]
        subprocess.run([sys.executable, "-m", "tfcli", *args], check=True, cwd=ROOT)
    return out


def rows(out: Path) -> tuple[list[dict], list[dict]]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r["split"] == "experts"], [r for r in records if r["split"] == "val"]


def main() -> None:
    from tfcli.engine.plots import figure, save_figure
    from tfcli.models.moe import imbalance

    plt = figure()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4), dpi=110)
    print("| router_aux_coef | held-out loss | busiest expert / mean, per layer (final) | mean over layers |")
    print("|---|---|---|---|")
    for weight in WEIGHTS:
        experts, val = rows(run(weight))
        steps = [r["step"] for r in experts]
        per_layer = [[imbalance(layer) for layer in r["load"]] for r in experts]
        mean = [sum(p) / len(p) for p in per_layer]
        left.plot(steps, mean, "o-", markersize=3, label=f"router_aux_coef {weight:g}")
        right.plot([r["step"] for r in val], [r["loss"] for r in val], "o-", markersize=3, label=f"{weight:g}")
        final = ", ".join(f"{x:.2f}" for x in per_layer[-1])
        print(f"| {weight:g} | {val[-1]['loss']:.4f} | {final} | {mean[-1]:.2f} |")
    left.set(xlabel="step", ylabel="busiest expert / mean (held out, mean over layers)")
    right.set(xlabel="step", ylabel="held-out loss")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"moe-mini, 8 experts top-2, {STEPS} steps: the load-balancing loss", fontsize=10)
    save_figure(fig, plt, FIGURE)
    print(f"wrote {FIGURE}")


if __name__ == "__main__":
    main()
