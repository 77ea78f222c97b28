"""`tfcli compare`: the question tfcli exists for, as one command. A grid of backbones x training
approaches (x tasks) is finetuned cell by cell to the same budget, each cell in its own process and
run directory (OUT/cells/<cell>); then one table (accuracy per split beside the majority class,
trained parameters, peak memory, training time, examples/s) is printed and written as Markdown and
CSV, with a chart of accuracy against trained parameters (one colour per family).

    tfcli compare --from runs/bert,runs/gpt,hf-minilm --train all,head,lora --task mnli --budget 10m --out study/

An approach is what `finetune --train` takes (all, head, lora, ia3, bitfit), `+head` for a classifier
head on pooled features instead of the label word as text (`lora+head`), `:POOLING` for how the
head pools (`head:mean`, `lora+head:last`), or `Kshot` for prompting with K solved examples and no
training at all (`0shot,4shot,8shot`: `tfcli eval --few-shot K`). Every cell's process is timed by
the operating system (CPU time, wait4's rusage); a training cell's peak memory is what its run logs,
a prompting cell's its rusage peak where that exceeds this process's own (otherwise "-").

Running the same command again finishes the grid: a cell with its eval.json is done and never run
again; an interrupted cell resumes from its last checkpoint; a failed cell is tried again.
"""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from itertools import product
from pathlib import Path

import yaml

from ..adapters import METHODS, method
from ..errors import UserError

METHOD_NAMES = tuple(METHODS)
POOLINGS = ("cls", "mean", "last", "last4-sum", "last4-concat", "encoder-mean", "decoder-first")
_APPROACH = re.compile(
    r"^(?:(?P<shots>\d+)-?shots?|(?P<train>[a-z0-9]+)(?P<head>\+head)?(?::(?P<pooling>[a-z0-9-]+))?)$"
)
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
        raise UserError(
            f"--budget {text!r}: give steps (500steps), examples (10000ex), time (10m, 1h) or epochs (1epoch)"
        )
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
class Approach:
    """One column of the grid: finetuning with `train` (a classifier head when `classifier`, pooled by
    `pooling`), or, when shots >= 0, k-shot prompting with nothing trained."""

    spec: str  # as the user wrote it: lora+head:mean, 4shot
    train: str = ""
    classifier: bool = False
    pooling: str = ""
    shots: int = -1

    @property
    def prompting(self) -> bool:
        return self.shots >= 0

    @property
    def slug(self) -> str:
        return self.spec.replace("+", "-").replace(":", "-")

    def flags(self) -> list[str]:
        """The finetune flags that make this approach (for a training cell)."""
        out = ["--train", self.train]
        if self.classifier:
            out += ["--head", "classifier"]  # a frozen GPT or T5 has no text head to train alone
        return out + (["--pooling", self.pooling] if self.pooling else [])


def parse_approach(text: str) -> Approach:
    """'lora' | 'lora+head' | 'head:mean' | 'lora+head:last' | '4shot'."""
    m = _APPROACH.match(text.strip())
    known = f"{', '.join(METHOD_NAMES)}; X+head, X:POOLING, Kshot"
    if not m or (m["train"] and m["train"] not in METHOD_NAMES):
        raise UserError(f"compare: unknown approach {text!r} (known: {known})")
    if m["shots"] is not None:
        return Approach(text, shots=int(m["shots"]))
    if m["pooling"] and m["pooling"] not in POOLINGS:
        raise UserError(f"compare: approach {text!r}: unknown pooling {m['pooling']!r} (known: {', '.join(POOLINGS)})")
    return Approach(
        text,
        train=m["train"],
        classifier=bool(m["head"]) or not method(m["train"]).backbone_trains,
        pooling=m["pooling"] or "",
    )


@dataclass(frozen=True)
class Cell:
    task: str
    backbone: str
    train: str  # the approach as written
    name: str
    sets: tuple[str, ...] = ()  # this cell's values of the grid's varied settings ("dpo.beta=0.3")

    @property
    def approach(self) -> Approach:
        return parse_approach(self.train)


@dataclass
class Grid:
    """The study: tasks x backbones x approaches, with what every cell shares."""

    tasks: list[str]
    backbones: list[str]
    approaches: list[str]
    budget: Budget
    data: str | None = None
    lr: dict[str, float] = field(default_factory=dict)  # approach -> learning rate (else the recipe's)
    sets: list[str] = field(default_factory=list)  # key=value overrides for every cell
    report_limit: int = 0  # every cell scored on a balanced sample of N examples of each split (0: all)
    vary: dict[str, list[str]] = field(default_factory=dict)  # key -> values: one more grid dimension each

    def cells(self) -> list[Cell]:
        """Tasks x models x approaches x every combination of the varied settings (a prompting cell
        trains nothing, so it is not repeated for them)."""
        slugs = unique_slugs(self.backbones)
        combos = [tuple(f"{k}={v}" for k, v in zip(self.vary, values)) for values in product(*self.vary.values())]
        out = []
        for t in self.tasks:
            for b in self.backbones:
                for s in self.approaches:
                    base = f"{t}-{slugs[b]}-{parse_approach(s).slug}"
                    for sets in [()] if parse_approach(s).prompting else combos:
                        suffix = "".join(f"-{k.rsplit('.', 1)[-1]}{v}" for k, v in (x.split("=", 1) for x in sets))
                        out.append(Cell(t, b, s, base + suffix, sets))
        return out


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


def split_list(text: str | None) -> list[str]:
    return [x.strip() for x in (text or "").split(",") if x.strip()]


def parse_vary(items: list[str]) -> dict[str, list[str]]:
    """['dpo.beta=0.1,0.3'] -> {'dpo.beta': ['0.1', '0.3']}: a setting the grid runs at each value."""
    out = {}
    for item in items:
        key, _, values = item.partition("=")
        if not key.strip() or not split_list(values):
            raise UserError(f"--vary {item!r}: give key.path=value1,value2, e.g. dpo.beta=0.1,0.3")
        out[key.strip()] = split_list(values)
    return out


def parse_lr(text: str | None) -> dict[str, float]:
    """'all=5e-5,lora=5e-4' -> {approach: lr} (an approach as written in --train, or its base: lora
    also sets lora+head's)."""
    out = {}
    for item in split_list(text):
        name, _, value = item.partition("=")
        try:
            out[name.strip()] = float(value)
        except ValueError:
            raise UserError(f"--lr {item!r}: give approach=rate, e.g. all=5e-5,lora=5e-4") from None
    return out


def load_grid(
    path: Path | None,
    tasks: str | None,
    backbones: str | None,
    approaches: str | None,
    budget: str | None,
    data: str | None,
    lr: str | None,
    sets: list[str],
    report_limit: int | None = None,
    vary: list[str] | None = None,
) -> Grid:
    """The grid from a YAML file (keys: tasks, from, train, budget, data, lr, set, vary, report_limit)
    with the flags over it."""
    spec: dict = {}
    if path is not None:
        try:
            spec = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise UserError(f"--grid {path}: unreadable ({e.__class__.__name__})") from None
        if not isinstance(spec, dict):
            raise UserError(f"--grid {path}: a mapping of tasks, from, train, budget, ...")
        keys = ("tasks", "task", "from", "train", "budget", "data", "lr", "set", "vary", "report_limit")
        unknown = set(spec) - set(keys)
        if unknown:
            raise UserError(f"--grid {path}: unknown key {sorted(unknown)[0]!r} ({', '.join(keys)})")

    def listed(flag: str | None, *keys: str) -> list[str]:
        if flag:
            return split_list(flag)
        value = next((spec[k] for k in keys if k in spec), [])
        return [str(v) for v in (value if isinstance(value, list) else split_list(str(value)))]

    grid = Grid(
        tasks=listed(tasks, "tasks", "task"),
        backbones=listed(backbones, "from"),
        approaches=listed(approaches, "train") or ["all"],
        budget=parse_budget(budget or spec.get("budget") or "1epoch"),
        data=data or spec.get("data"),
        lr={**{k: float(v) for k, v in (spec.get("lr") or {}).items()}, **parse_lr(lr)},
        sets=[f"{k}={v}" for k, v in (spec.get("set") or {}).items()] + list(sets),
        report_limit=int(report_limit if report_limit is not None else spec.get("report_limit", 0)),
        vary={
            **{
                k: [str(x) for x in (v if isinstance(v, list) else split_list(str(v)))]
                for k, v in (spec.get("vary") or {}).items()
            },
            **parse_vary(vary or []),
        },
    )
    check(grid)
    refuse_code_from_the_file(path, spec, sets, vary or [])
    return grid


def refuse_code_from_the_file(path: Path | None, spec: dict, sets: list[str], vary: list[str]) -> None:
    """A grid file is data: a reward function (file.py:function) it names runs only when the command
    line names it too (--set grpo.reward=...), as every command's own reward does."""
    from ..tasks.rewards import user_functions

    named = user_functions(*_values(sets), *(v for values in parse_vary(vary).values() for v in values))
    in_file = user_functions(
        *(str(v) for v in (spec.get("set") or {}).values()),
        *(
            str(v)
            for values in (spec.get("vary") or {}).values()
            for v in (values if isinstance(values, list) else [values])
        ),
    )
    if in_file - named:
        code = sorted(in_file - named)[0]
        key, value = next(
            ((k, str(v)) for k, v in (spec.get("set") or {}).items() if code in user_functions(str(v))),
            ("grpo.reward", code),
        )  # the field that names it (a reward, tools, an environment) and all it holds
        raise UserError(
            f"--grid {path} names the {key.split('.')[-1]} {code}, Python code that tfcli imports only when the "
            f"command line names it: add --set {key}={value}"
        )


def _values(sets: list[str]) -> list[str]:
    from .. import recipe as recipes

    return [str(recipes.parse_override(s)[1]) for s in sets]


def code_sets(cell: Cell, grid: Grid) -> list[str]:
    """The cell's settings that name the user's code (a reward function): a resumed cell names it again,
    since a run's record of it is not enough to run it."""
    from ..tasks.rewards import user_functions

    return [x for s in [*grid.sets, *cell.sets] if user_functions(*_values([s])) for x in ("--set", s)]


def check(grid: Grid) -> None:
    from .. import registry
    from ..tasks.presets import PRESETS

    if not grid.tasks:
        raise UserError("compare: name the task(s) (--task mnli)")
    if not grid.backbones:
        raise UserError("compare: name the models to compare (--from RUN,HF_DIR,...)")
    for t in grid.tasks:
        if t not in registry.TASKS and t not in PRESETS:
            raise UserError(f"compare: unknown task {t!r} (known: {', '.join(sorted([*registry.TASKS, *PRESETS]))})")
    for s in grid.approaches + list(grid.lr):
        parse_approach(s)
    if grid.report_limit < 0:
        raise UserError(f"compare: --report-limit {grid.report_limit}: give N >= 0 (0: every example)")
    from ..recipe import parse_override
    from .common import is_model_setting

    model_keys = [k for k in [parse_override(s)[0] for s in grid.sets] + list(grid.vary) if is_model_setting(k)]
    if model_keys:  # finetune --from would refuse it in every cell's process
        raise UserError(
            f"compare: {model_keys[0]}: each cell's model comes from its --from source as saved; "
            f"model.* cannot be set or varied"
        )


def cell_recipe(cell: Cell, grid: Grid):
    """The recipe a training cell of this task and model starts from: the task's default for the
    model's family, with the grid's settings."""
    from .. import recipe as recipes
    from ..engine import model_source
    from ..tasks.presets import task_target

    key, settings, defaults = task_target(cell.task)
    family = model_source.resolve(cell.backbone).family
    if family not in defaults:
        raise UserError(f"compare: {cell.task} has no recipe for {cell.backbone} (a {family!r} model)")
    overrides = dict(recipes.parse_override(s) for s in grid.sets)
    return recipes.load(defaults[family], {**{f"{key}.{k}": v for k, v in settings.items()}, **overrides})


def held_out_file(cell: Cell, grid: Grid, out: Path) -> Path | None:
    """One data file is split by every training cell (data.val_fraction, seeded by train.seed): the
    prompting cells score exactly those held-out rows, written once to OUT/held-out/<task>-<family>.jsonl."""
    if not grid.data or not Path(grid.data).is_file():
        return None
    from ..data.labelled import held_out_rows

    recipe = cell_recipe(cell, grid)
    path = Path(out) / "held-out" / f"{cell.task}-{recipe.model.family}.jsonl"
    if not path.is_file():
        rows = held_out_rows(Path(grid.data), recipe.data.val_fraction, recipe.train.seed)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def task_sets(cell: Cell, grid: Grid) -> list[str]:
    """The grid's settings of the task's own section (sft.max_new_tokens, ...): what an evaluation of
    a prompting cell takes, so that it scores as the training cells' reports do."""
    from ..tasks.presets import task_target

    key = task_target(cell.task)[0]
    return [s for s in grid.sets if s.startswith(f"{key}.")]


def reply_limits(cell: Cell, grid: Grid, out: Path) -> list[str]:
    """A generative task (sft) generates replies for its first sft.generate_limit held-out rows at the
    end of training, and an evaluation for its first --limit: every cell generates for the same rows
    (--report-limit N, else every held-out row of a single data file)."""
    from ..tasks.presets import task_target

    if task_target(cell.task)[0] != "sft" or not grid.data:
        return []
    n = grid.report_limit or held_out_count(cell, grid, out)
    return ["--set", f"sft.generate_limit={n}", "--set", f"finetune.report_limit={n}"] if n else []


def held_out_count(cell: Cell, grid: Grid, out: Path) -> int:
    """The most rows of any held-out split of the grid's data: of the held-out file a single data file
    gives, or of the evaluation split files of a directory (GSM8K's test.jsonl)."""
    held = held_out_file(cell, grid, out)
    if held is not None:
        return len(Path(held).read_text().splitlines())
    from .. import registry
    from ..data.labelled import raw_splits

    recipe = cell_recipe(cell, grid)
    spec = registry.plugin_class("task", recipe.plugin).data_spec(recipe.settings)
    splits = raw_splits(spec, grid.data, "", recipe.data.val_fraction, recipe.train.seed, need_train=False)
    return max((len(rows) for rows, *_ in list(splits.values())[1:]), default=0)


def cell_command(cell: Cell, grid: Grid, run_dir: Path) -> list[str]:
    """The tfcli command of one cell: `finetune` (a new run, or the resumption of an interrupted
    one), or `eval --few-shot K` for a prompting cell. Every cell is scored on the same held-out rows
    with the same settings of the task."""
    approach, out = cell.approach, run_dir.parent.parent
    if approach.prompting:
        cmd = [
            sys.executable,
            "-m",
            "tfcli",
            "eval",
            cell.task,
            "--quiet",
            "--checkpoint",
            cell.backbone,
            "--few-shot",
            str(approach.shots),
            "--limit",
            str(grid.report_limit),
            "--out",
            str(run_dir / "eval.json"),
        ]
        held = held_out_file(cell, grid, out)
        cmd += ["--data", str(held or grid.data)] if grid.data else []
        return cmd + [x for s in task_sets(cell, grid) for x in ("--set", s)]
    base = [sys.executable, "-m", "tfcli", "finetune", cell.task, "--quiet"]
    if (run_dir / "config.yaml").is_file():
        return base + ["--resume", str(run_dir), *code_sets(cell, grid)]
    cmd = base + ["--from", cell.backbone, *approach.flags(), "--out", str(run_dir), *grid.budget.flags()]
    if grid.data:
        cmd += ["--data", grid.data]
    lr = grid.lr.get(cell.train, grid.lr.get(approach.train))
    if lr is not None:
        cmd += ["--lr", str(lr)]
    for s in [f"finetune.report_limit={grid.report_limit}"] * bool(grid.report_limit) + grid.sets + list(cell.sets):
        cmd += ["--set", s]
    return cmd + reply_limits(cell, grid, out)


def run_grid(grid: Grid, out: Path, quiet: bool = False) -> list[dict]:
    """Run every unfinished cell, one after another; return every cell's row."""
    from ..display import console, phase

    out = Path(out)
    (out / "cells").mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(exist_ok=True)
    (out / "grid.yaml").write_text(
        yaml.safe_dump(
            {
                "tasks": grid.tasks,
                "from": grid.backbones,
                "train": grid.approaches,
                "budget": str(grid.budget),
                "data": grid.data,
                "lr": grid.lr,
                "set": grid.sets,
                "vary": grid.vary,
                "report_limit": grid.report_limit,
            },
            sort_keys=False,
        )
    )
    cells = grid.cells()
    for i, cell in enumerate(cells, 1):
        run_dir = out / "cells" / cell.name
        if (run_dir / "eval.json").is_file():
            continue
        if run_dir.exists() and any(run_dir.iterdir()) and not (run_dir / "config.yaml").is_file():
            console.print(
                f"[yellow]skipping {cell.name}:[/] {run_dir} exists but holds no run; remove it to run the cell"
            )
            continue
        cmd = cell_command(cell, grid, run_dir)
        started = time.time()
        if cell.approach.prompting:
            run_dir.mkdir(parents=True, exist_ok=True)
        with phase(f"cell {i}/{len(cells)}: {cell.name}"), open(out / "logs" / f"{cell.name}.log", "a") as log:
            log.write(f"$ {' '.join(cmd)}\n")
            log.flush()
            rc, usage = run_cell(cmd, log)
        if run_dir.is_dir():
            record_usage(run_dir, usage, time.time() - started)
        if not quiet:
            status = "done" if rc == 0 else f"[red]failed[/] ({last_line(out / 'logs' / f'{cell.name}.log')})"
            console.print(f"cell {i}/{len(cells)} {cell.name}: {status} in {time.time() - started:.0f} s")
    return [collect(cell, out) for cell in cells]


def run_cell(cmd: list[str], log):
    """The cell's process -> (exit code, its rusage). Ctrl-C lets it checkpoint at its next step,
    then stops the grid. The rusage's ru_maxrss is this process's peak at the start when the cell's
    own was lower (it survives fork and exec): `record_usage` keeps only a peak above it."""
    from ..engine.perf import peak_resident_bytes

    own_peak_kb = peak_resident_bytes() / 1024
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        _, status, usage = os.wait4(proc.pid, 0)
    except KeyboardInterrupt:
        proc.wait()
        raise UserError(
            "compare interrupted: the running cell saved a checkpoint; run the same command again to finish the grid"
        ) from None
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, CellUsage(usage.ru_utime + usage.ru_stime, usage.ru_maxrss, own_peak_kb)


@dataclass(frozen=True)
class CellUsage:
    """What the cell's process used: CPU seconds, and its rusage peak beside the peak it inherited."""

    cpu_s: float
    maxrss_kb: float
    inherited_kb: float

    @property
    def peak_mb(self) -> float | None:
        """The cell's own peak, where the rusage can tell it (above what it inherited)."""
        return self.maxrss_kb / 1024 if self.maxrss_kb > self.inherited_kb * 1.01 else None


def record_usage(run_dir: Path, usage: CellUsage, wall_s: float) -> None:
    """The cell's CPU seconds and wall seconds (summed over its attempts) and, where its rusage tells
    it, its peak resident memory, in usage.json. A training cell's run logs its own peak besides."""
    path = run_dir / "usage.json"
    before = json.loads(path.read_text()) if path.is_file() else {}
    peaks = [p for p in (before.get("peak_rss_mb"), usage.peak_mb) if p is not None]
    path.write_text(
        json.dumps(
            {
                "cpu_s": round(before.get("cpu_s", 0) + usage.cpu_s, 1),
                "wall_s": round(before.get("wall_s", 0) + wall_s, 1),
                **({"peak_rss_mb": round(max(peaks), 1)} if peaks else {}),
            }
        )
    )


def last_line(log: Path) -> str:
    lines = [line for line in log.read_text().splitlines() if line.strip()]
    return lines[-1][:200] if lines else "no output"


def collect(cell: Cell, out: Path) -> dict:
    """One cell's row, from its directory (status only, for a cell that did not finish)."""
    run = out / "cells" / cell.name
    row: dict = {
        "cell": cell.name,
        "task": cell.task,
        "backbone": cell.backbone,
        "train": cell.train,
        **({"setting": " ".join(cell.sets)} if cell.sets else {}),
    }
    if not (run / "eval.json").is_file():
        log = out / "logs" / f"{cell.name}.log"
        row["status"] = f"failed: {last_line(log)}" if log.is_file() else "not run"
        return row
    report = json.loads((run / "eval.json").read_text())
    usage = json.loads((run / "usage.json").read_text()) if (run / "usage.json").is_file() else {}
    from .runs import split_scores

    scores = split_scores(report)
    splits = list(scores) or [s for s, r in report.items() if isinstance(r, dict) and "loss" in r]
    row["status"] = "done"
    row.update(prompting_row(cell, report, splits, usage) if cell.approach.prompting else training_row(run))
    for split in splits:
        if split in scores:
            row[f"{split}_acc"] = round(scores[split][1], 4)
        if "loss" in report[split]:  # a generative task's held-out reply loss (sft); kto's, distill's alone
            row[f"{split}_loss"] = round(report[split]["loss"], 4)
    majority = report[splits[0]].get("majority") if splits else None
    row["majority"] = round(majority, 4) if majority is not None else None
    row["scored"] = sum(report[s].get("n", 0) for s in splits)
    row["cpu_s"] = usage.get("cpu_s")
    row["peak_mem_mb"] = row.get("peak_mem_mb") or usage.get("peak_rss_mb")
    return row


def training_row(run: Path) -> dict:
    """What a finetuning cell's run directory says: family, steps, parameters, memory, speed."""
    config = yaml.safe_load((run / "config.yaml").read_text())
    record = json.loads((run / "run.json").read_text()) if (run / "run.json").is_file() else {}
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [m for m in metrics if m.get("split") == "train"]
    rates = [m["ex_per_s"] for m in train if "ex_per_s" in m]
    if not rates and train and train[-1].get("elapsed_s"):  # a text head logs tokens/s: count examples instead
        t = config["train"]
        rates = [train[-1]["step"] * t["batch_size"] * t.get("grad_accum", 1) / train[-1]["elapsed_s"]]
    params = record.get("parameters", {})
    return {
        "family": config["model"]["family"],
        "steps": train[-1]["step"] if train else 0,
        "trained_params": params.get("trained"),
        "total_params": params.get("total"),
        "peak_mem_mb": max((m.get("peak_mem_mb", 0) for m in train), default=None),
        "train_s": train[-1]["elapsed_s"] if train else None,
        "ex_per_s": round(sorted(rates)[len(rates) // 2], 1) if rates else None,
    }


def prompting_row(cell: Cell, report: dict, splits: list[str], usage: dict) -> dict:
    """A k-shot cell trains nothing: its speed is examples scored per second of the whole command."""
    from ..engine import model_source

    scored = sum(report[s].get("n", 0) for s in splits)
    wall = usage.get("wall_s")
    return {
        "family": model_source.resolve(cell.backbone).family,  # it was just evaluated: it resolves
        "steps": 0,
        "trained_params": 0,
        "train_s": None,
        "ex_per_s": round(scored / wall, 1) if wall else None,
    }


def write_tables(rows: list[dict], out: Path) -> tuple[Path, Path]:
    """results.csv (every field) and results.md (the readable table)."""
    columns = list(dict.fromkeys(k for r in rows for k in r))
    with open(out / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    acc = [c for c in columns if c.endswith(("_acc", "_loss"))]
    head = ["cell", "train", *acc, "majority", "scored", "trained params", "peak MB", "train time", "CPU time", "ex/s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if r.get("status") != "done":
            lines.append(f"| {r['cell']} | {r['train']} | " + " | ".join([r["status"]] + [""] * (len(head) - 3)) + " |")
            continue
        lines.append(
            "| "
            + " | ".join(
                [
                    r["cell"],
                    r["train"],
                    *(metric_text(r, a) for a in acc),
                    pct(r["majority"]),
                    str(r.get("scored") or "-"),
                    params_text(r),
                    mb(r["peak_mem_mb"]),
                    seconds(r["train_s"]),
                    seconds(r.get("cpu_s")),
                    rate(r),
                ]
            )
            + " |"
        )
    (out / "results.md").write_text("\n".join(lines) + "\n")
    return out / "results.md", out / "results.csv"


def metric_text(r: dict, column: str) -> str:
    """An accuracy as a percentage, a loss as it is."""
    if column.endswith("_loss"):
        return f"{r[column]:.4f}" if isinstance(r.get(column), float) else "-"
    return pct(r.get(column))


def rate(r: dict) -> str:
    return f"{r['ex_per_s']:g}" if r.get("ex_per_s") else "-"


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
    if t == 0:
        return "none (prompting)"
    return f"{count(t)} ({100 * t / n:.3g}%)" if t and n else "-"


def chart(rows: list[dict], out: Path) -> Path | None:
    """Accuracy on the first evaluation split against trained parameters (log scale): one colour per
    family, one marker per approach, the majority class as a dashed line."""
    from ..engine.plots import figure, save_figure

    done = [r for r in rows if r.get("status") == "done" and r.get("trained_params")]
    if not done:
        return None  # (a grid of prompting cells only has nothing to plot against trained parameters)
    acc = next((k for k in done[0] if k.endswith("_acc")), None)
    if acc is None:
        return None  # (a task scored by its loss alone, KTO's or distillation's: the table says it)
    plt = figure()
    fig, ax = plt.subplots(figsize=(10, 4.5), dpi=110)
    colours = {f: f"C{i}" for i, f in enumerate(dict.fromkeys(r["family"] for r in done))}
    at: dict[tuple, list[str]] = {}  # points carry numbers (cells on one spot share a label); names go in the key
    for i, r in enumerate(done, 1):
        ax.scatter(r["trained_params"], 100 * r[acc], color=colours[r["family"]], marker=marker(r["train"]), s=40)
        at.setdefault((r["trained_params"], round(100 * r[acc], 1)), []).append(str(i))
    for (x, y), numbers in at.items():
        ax.annotate(",".join(numbers), (x, y), fontsize=7, xytext=(4, 3), textcoords="offset points")
    key = "\n".join(
        f"{i:>2}  {Path(r['backbone']).name} {r['train']}  {100 * r[acc]:.1f}%" for i, r in enumerate(done, 1)
    )
    ax.text(1.02, 1.0, key, transform=ax.transAxes, fontsize=7, family="monospace", va="top")
    if done[0].get("majority"):
        ax.axhline(100 * done[0]["majority"], linestyle="--", color="0.5", linewidth=1, label="majority class")
    prompted = [
        r for r in rows if r.get("status") == "done" and r.get("trained_params") == 0 and r.get(acc) is not None
    ]
    for j, r in enumerate(prompted):  # nothing trained: a line at its accuracy, not a point
        ax.axhline(
            100 * r[acc],
            linestyle=":",
            color=f"C{len(colours) + j}",
            linewidth=1.2,
            label=f"{r['train']} prompting {100 * r[acc]:.1f}%",
        )
    for family, colour in colours.items():
        ax.scatter([], [], color=colour, label=family)
    for approach in dict.fromkeys(r["train"] for r in done):
        ax.scatter([], [], color="0.3", marker=marker(approach), label=approach)
    ax.set_xscale("log")
    ax.set_xlabel("trained parameters")
    ax.set_ylabel(f"{acc[:-4]} accuracy (%)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower left", bbox_to_anchor=(1.02, 0.0))
    return save_figure(fig, plt, out / "results.png")


def marker(spec: str) -> str:
    """One marker per training approach; a classifier head on an adapter is filled differently."""
    approach = parse_approach(spec)
    return (
        dict(zip(METHOD_NAMES, "osDP^v")).get(approach.train, "o")
        if not (approach.classifier and method(approach.train).backbone_trains)
        else "P"
    )


def show(rows: list[dict]) -> None:
    from rich.table import Column, Table

    from ..display import console

    columns = list(dict.fromkeys(k for r in rows for k in r if k.endswith(("_acc", "_loss"))))
    widest = max((len(r["cell"]) for r in rows), default=4)  # the cell names are never cut: the numbers wrap first
    table = Table(
        Column("cell", no_wrap=True, min_width=widest),
        *(c.replace("_acc", "").replace("_", " ") for c in columns),
        "majority",
        "trained",
        "peak MB",
        "time",
        "CPU",
        "ex/s",
        title="tfcli compare (accuracy per split)",
    )
    for r in rows:
        if r.get("status") != "done":
            table.add_row(r["cell"], f"[red]{r['status']}[/]")
            continue
        table.add_row(
            r["cell"],
            *(metric_text(r, c) for c in columns),
            pct(r["majority"]),
            params_text(r),
            mb(r["peak_mem_mb"]),
            seconds(r["train_s"]),
            seconds(r.get("cpu_s")),
            rate(r),
        )
    console.print(table)
