"""`tfcli compare`: the question tfcli exists for, as one command. A grid of backbones x training
strategies (x tasks) is finetuned cell by cell to the same budget, each cell in its own process and
run directory (OUT/cells/<cell>); then one table (accuracy per split beside the majority class,
trained parameters, peak memory, training time, examples/s) is printed and written as Markdown and
CSV, with a chart of accuracy against trained parameters (one colour per family).

    tfcli compare --from runs/bert,runs/gpt,hf-minilm --train all,head,lora --task mnli --budget 10m --out study/

Running the same command again finishes the grid: a cell with its eval.json is done and never run
again; an interrupted cell resumes from its last checkpoint; a failed cell is tried again.
"""
from __future__ import annotations

import csv
import json
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import yaml

from .errors import UserError

STRATEGIES = ("all", "head", "lora", "ia3", "bitfit")
_BUDGET = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(steps?|ex|examples?|m|min|minutes?|h|hours?|epochs?)\s*$")


@dataclass(frozen=True)
class Budget:
    """What every cell gets: optimizer steps, training examples (one epoch over the first N rows),
    minutes of training (train.max_time), or epochs."""

    kind: str  # steps | examples | minutes | epochs
    amount: float

    def flags(self) -> list[str]:
        if self.kind == "steps":
            return ["--steps", str(int(self.amount))]
        if self.kind == "examples":
            return ["--limit", str(int(self.amount)), "--epochs", "1"]
        if self.kind == "minutes":
            return ["--set", f"train.max_time={self.amount:g}"]
        return ["--epochs", f"{self.amount:g}"]

    def __str__(self) -> str:
        unit = {"steps": "steps", "examples": "examples", "minutes": "min", "epochs": "epochs"}[self.kind]
        return f"{self.amount:g} {unit}"


def parse_budget(text: str) -> Budget:
    """'500steps', '10000ex', '10m', '1h', '1epoch'."""
    m = _BUDGET.match(str(text))
    if not m:
        raise UserError(f"--budget {text!r}: give steps (500steps), examples (10000ex), time (10m, 1h) or epochs (1epoch)")
    amount, unit = float(m.group(1)), m.group(2)
    if amount <= 0:
        raise UserError(f"--budget {text!r}: must be more than 0")
    if unit.startswith("step"):
        return Budget("steps", amount)
    if unit.startswith("ex"):
        return Budget("examples", amount)
    if unit.startswith("epoch"):
        return Budget("epochs", amount)
    return Budget("minutes", amount * (60 if unit.startswith("h") else 1))


@dataclass(frozen=True)
class Cell:
    task: str
    backbone: str
    train: str
    name: str


@dataclass
class Grid:
    """The study: tasks x backbones x strategies, with what every cell shares."""

    tasks: list[str]
    backbones: list[str]
    strategies: list[str]
    budget: Budget
    data: Optional[str] = None
    lr: dict[str, float] = field(default_factory=dict)  # strategy -> learning rate (else the recipe's)
    sets: list[str] = field(default_factory=list)  # key=value overrides for every cell

    def cells(self) -> list[Cell]:
        slugs = unique_slugs(self.backbones)
        return [Cell(t, b, s, f"{t}-{slugs[b]}-{s}") for t in self.tasks for b in self.backbones for s in self.strategies]


def unique_slugs(paths: list[str]) -> dict[str, str]:
    """A short name per backbone: its last path part, with its parent's where two would clash."""
    def slug(p: str, depth: int) -> str:
        parts = [x for x in Path(p).parts if x not in ("/", ".", "..")][-depth:]
        return re.sub(r"[^A-Za-z0-9_.-]+", "_", "-".join(parts)) or "model"

    for depth in (1, 2, 3):
        names = {p: slug(p, depth) for p in paths}
        if len(set(names.values())) == len(paths):
            return names
    return {p: f"{slug(p, 1)}{i}" for i, p in enumerate(paths)}


def split_list(text: Optional[str]) -> list[str]:
    return [x.strip() for x in (text or "").split(",") if x.strip()]


def parse_lr(text: Optional[str]) -> dict[str, float]:
    """'all=5e-5,lora=5e-4' -> {strategy: lr}."""
    out = {}
    for item in split_list(text):
        name, _, value = item.partition("=")
        try:
            out[name.strip()] = float(value)
        except ValueError:
            raise UserError(f"--lr {item!r}: give strategy=rate, e.g. all=5e-5,lora=5e-4") from None
    return out


def load_grid(path: Optional[Path], tasks: Optional[str], backbones: Optional[str], strategies: Optional[str],
              budget: Optional[str], data: Optional[str], lr: Optional[str], sets: list[str]) -> Grid:
    """The grid from a YAML file (keys: tasks, from, train, budget, data, lr, set) with the flags over it."""
    spec: dict = {}
    if path is not None:
        try:
            spec = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise UserError(f"--grid {path}: unreadable ({e.__class__.__name__})") from None
        if not isinstance(spec, dict):
            raise UserError(f"--grid {path}: a mapping of tasks, from, train, budget, ...")
        unknown = set(spec) - {"tasks", "task", "from", "train", "budget", "data", "lr", "set"}
        if unknown:
            raise UserError(f"--grid {path}: unknown key {sorted(unknown)[0]!r} (tasks, from, train, budget, data, lr, set)")

    def listed(flag: Optional[str], *keys: str) -> list[str]:
        if flag:
            return split_list(flag)
        value = next((spec[k] for k in keys if k in spec), [])
        return [str(v) for v in (value if isinstance(value, list) else split_list(str(value)))]

    grid = Grid(tasks=listed(tasks, "tasks", "task"), backbones=listed(backbones, "from"),
                strategies=listed(strategies, "train") or ["all"],
                budget=parse_budget(budget or spec.get("budget") or "1epoch"), data=data or spec.get("data"),
                lr={**{k: float(v) for k, v in (spec.get("lr") or {}).items()}, **parse_lr(lr)},
                sets=[f"{k}={v}" for k, v in (spec.get("set") or {}).items()] + list(sets))
    check(grid)
    return grid


def check(grid: Grid) -> None:
    from . import registry
    from .tasks.presets import PRESETS

    if not grid.tasks:
        raise UserError("compare: name the task(s) (--task mnli)")
    if not grid.backbones:
        raise UserError("compare: name the models to compare (--from RUN,HF_DIR,...)")
    for t in grid.tasks:
        if t not in registry.TASKS and t not in PRESETS:
            raise UserError(f"compare: unknown task {t!r} (known: {', '.join(sorted([*registry.TASKS, *PRESETS]))})")
    for s in grid.strategies + list(grid.lr):
        if s not in STRATEGIES:
            raise UserError(f"compare: unknown strategy {s!r} (known: {', '.join(STRATEGIES)})")


def cell_command(cell: Cell, grid: Grid, run_dir: Path) -> list[str]:
    """The `tfcli finetune` command of one cell: a new run, or the resumption of an interrupted one."""
    base = [sys.executable, "-m", "tfcli", "finetune", cell.task, "--quiet"]
    if (run_dir / "config.yaml").is_file():
        return base + ["--resume", str(run_dir)]
    cmd = base + ["--from", cell.backbone, "--train", cell.train, "--out", str(run_dir), *grid.budget.flags()]
    if cell.train == "head":
        cmd += ["--head", "classifier"]  # a frozen GPT or T5 has no text head to train alone
    if grid.data:
        cmd += ["--data", grid.data]
    if cell.train in grid.lr:
        cmd += ["--lr", str(grid.lr[cell.train])]
    for s in grid.sets:
        cmd += ["--set", s]
    return cmd


def run_grid(grid: Grid, out: Path, quiet: bool = False) -> list[dict]:
    """Run every unfinished cell, one after another; return every cell's row."""
    from .display import console, phase

    out = Path(out)
    (out / "cells").mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(exist_ok=True)
    (out / "grid.yaml").write_text(yaml.safe_dump({"tasks": grid.tasks, "from": grid.backbones, "train": grid.strategies,
                                                    "budget": str(grid.budget), "data": grid.data, "lr": grid.lr,
                                                    "set": grid.sets}, sort_keys=False))
    cells = grid.cells()
    for i, cell in enumerate(cells, 1):
        run_dir = out / "cells" / cell.name
        if (run_dir / "eval.json").is_file():
            continue
        if run_dir.exists() and any(run_dir.iterdir()) and not (run_dir / "config.yaml").is_file():
            console.print(f"[yellow]skipping {cell.name}:[/] {run_dir} exists but holds no run; remove it to run the cell")
            continue
        cmd = cell_command(cell, grid, run_dir)
        started = time.time()
        with phase(f"cell {i}/{len(cells)}: {cell.name}"), open(out / "logs" / f"{cell.name}.log", "a") as log:
            log.write(f"$ {' '.join(cmd)}\n")
            log.flush()
            rc = run_cell(cmd, log)
        if not quiet:
            status = "done" if rc == 0 else f"[red]failed[/] ({last_line(out / 'logs' / f'{cell.name}.log')})"
            console.print(f"cell {i}/{len(cells)} {cell.name}: {status} in {time.time() - started:.0f} s")
    return [collect(cell, out) for cell in cells]


def run_cell(cmd: list[str], log) -> int:
    """The cell's process; Ctrl-C lets it checkpoint at its next step, then stops the grid."""
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        proc.wait()
        raise UserError("compare interrupted: the running cell saved a checkpoint; run the same command "
                        "again to finish the grid") from None


def last_line(log: Path) -> str:
    lines = [line for line in log.read_text().splitlines() if line.strip()]
    return lines[-1][:200] if lines else "no output"


def collect(cell: Cell, out: Path) -> dict:
    """One cell's row, from its run directory (status only, for a cell that did not finish)."""
    run = out / "cells" / cell.name
    row: dict = {"cell": cell.name, "task": cell.task, "backbone": cell.backbone, "train": cell.train}
    if not (run / "eval.json").is_file():
        log = out / "logs" / f"{cell.name}.log"
        row["status"] = f"failed: {last_line(log)}" if log.is_file() else "not run"
        return row
    report = json.loads((run / "eval.json").read_text())
    config = yaml.safe_load((run / "config.yaml").read_text())
    record = json.loads((run / "run.json").read_text()) if (run / "run.json").is_file() else {}
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [m for m in metrics if m.get("split") == "train"]
    rates = [m["ex_per_s"] for m in train if "ex_per_s" in m]
    if not rates and train and train[-1].get("elapsed_s"):  # a text head logs tokens/s: count examples instead
        t = config["train"]
        rates = [train[-1]["step"] * t["batch_size"] * t.get("grad_accum", 1) / train[-1]["elapsed_s"]]
    params = record.get("parameters", {})
    row.update({"status": "done", "family": config["model"]["family"], "steps": train[-1]["step"] if train else 0})
    splits = [k for k, v in report.items() if isinstance(v, dict) and "acc" in v]
    for split in splits:
        row[f"{split}_acc"] = round(report[split]["acc"], 4)
    row["majority"] = round(report[splits[0]]["majority"], 4) if splits else None
    row.update({"trained_params": params.get("trained"), "total_params": params.get("total"),
                "peak_mem_mb": max((m.get("peak_mem_mb", 0) for m in train), default=None),
                "train_s": train[-1]["elapsed_s"] if train else None,
                "ex_per_s": round(sorted(rates)[len(rates) // 2], 1) if rates else None})
    return row


def write_tables(rows: list[dict], out: Path) -> tuple[Path, Path]:
    """results.csv (every field) and results.md (the readable table)."""
    columns = list(dict.fromkeys(k for r in rows for k in r))
    with open(out / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    acc = [c for c in columns if c.endswith("_acc")]
    head = ["cell", "train", *acc, "majority", "trained params", "peak MB", "train time", "ex/s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if r.get("status") != "done":
            lines.append(f"| {r['cell']} | {r['train']} | " + " | ".join([r["status"]] + [""] * (len(head) - 3)) + " |")
            continue
        lines.append("| " + " | ".join([r["cell"], r["train"], *(pct(r.get(a)) for a in acc), pct(r["majority"]),
                                        params_text(r), mb(r["peak_mem_mb"]), seconds(r["train_s"]),
                                        f"{r['ex_per_s']:g}" if r["ex_per_s"] else "-"]) + " |")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    return out / "results.md", out / "results.csv"


def pct(v) -> str:
    return f"{100 * v:.2f}" if isinstance(v, (int, float)) else "-"


def mb(v) -> str:
    return f"{v:,.0f}" if v else "-"


def seconds(v) -> str:
    if not v:
        return "-"
    return f"{v:.0f} s" if v < 90 else f"{v / 60:.1f} min"


def count(n: float) -> str:
    """99, 4.19K, 1.03M: a parameter count as people write it."""
    for size, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:.0f}"


def params_text(r: dict) -> str:
    t, n = r.get("trained_params"), r.get("total_params")
    return f"{count(t)} ({100 * t / n:.3g}%)" if t and n else "-"


def chart(rows: list[dict], out: Path) -> Optional[Path]:
    """Accuracy on the first evaluation split against trained parameters (log scale): one colour per
    family, one marker per strategy, the majority class as a dashed line."""
    from .plots import figure, save_figure

    done = [r for r in rows if r.get("status") == "done" and r.get("trained_params")]
    if not done:
        return None
    acc = next(k for k in done[0] if k.endswith("_acc"))
    plt = figure()
    fig, ax = plt.subplots(figsize=(10, 4.5), dpi=110)
    colours = {f: f"C{i}" for i, f in enumerate(dict.fromkeys(r["family"] for r in done))}
    markers = dict(zip(STRATEGIES, "osD^v"))
    at: dict[tuple, list[str]] = {}  # points carry numbers (cells on one spot share a label); names go in the key
    for i, r in enumerate(done, 1):
        ax.scatter(r["trained_params"], 100 * r[acc], color=colours[r["family"]], marker=markers.get(r["train"], "o"), s=40)
        at.setdefault((r["trained_params"], round(100 * r[acc], 1)), []).append(str(i))
    for (x, y), numbers in at.items():
        ax.annotate(",".join(numbers), (x, y), fontsize=7, xytext=(4, 3), textcoords="offset points")
    key = "\n".join(f"{i:>2}  {Path(r['backbone']).name} {r['train']}  {100 * r[acc]:.1f}%" for i, r in enumerate(done, 1))
    ax.text(1.02, 1.0, key, transform=ax.transAxes, fontsize=7, family="monospace", va="top")
    if done[0].get("majority"):
        ax.axhline(100 * done[0]["majority"], linestyle="--", color="0.5", linewidth=1, label="majority class")
    for family, colour in colours.items():
        ax.scatter([], [], color=colour, label=family)
    for strategy in dict.fromkeys(r["train"] for r in done):
        ax.scatter([], [], color="0.3", marker=markers.get(strategy, "o"), label=strategy)
    ax.set_xscale("log")
    ax.set_xlabel("trained parameters")
    ax.set_ylabel(f"{acc[:-4]} accuracy (%)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower left", bbox_to_anchor=(1.02, 0.0))
    return save_figure(fig, plt, out / "results.png")


def show(rows: list[dict]) -> None:
    from rich.table import Table

    from .display import console

    from rich.table import Column

    columns = list(dict.fromkeys(k for r in rows for k in r if k.endswith("_acc")))
    widest = max((len(r["cell"]) for r in rows), default=4)  # the cell names are never cut: the numbers wrap first
    table = Table(Column("cell", no_wrap=True, min_width=widest), *(c[:-4] for c in columns), "majority", "trained",
                  "peak MB", "time", "ex/s", title="tfcli compare (accuracy per split)")
    for r in rows:
        if r.get("status") != "done":
            table.add_row(r["cell"], f"[red]{r['status']}[/]")
            continue
        table.add_row(r["cell"], *(pct(r.get(c)) for c in columns), pct(r["majority"]), params_text(r),
                      mb(r["peak_mem_mb"]), seconds(r["train_s"]), f"{r['ex_per_s']:g}" if r["ex_per_s"] else "-")
    console.print(table)
