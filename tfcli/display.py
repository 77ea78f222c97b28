"""What a run shows: a live progress bar that moves every step, labelled spinners for slow phases,
and plain log lines everywhere (a file, a pipe, CI).

`configure(enabled)` is called once by the driver: only rank 0 of a run that is not --quiet shows
anything live, and only on a terminal; everything else prints plain lines or nothing.
"""

from __future__ import annotations

import contextlib
import time

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

console = Console(highlight=False, soft_wrap=True)
errors = Console(stderr=True, highlight=False, soft_wrap=True)  # notes: not in what a command's output pipes on
_state = {"live": True, "progress": None}  # may phases and bars draw; the training bar, while it runs
PIPED_EVERY_S = 30.0  # a phase with a known total, printed to a pipe or a file: a progress line this often


def configure(enabled: bool) -> None:
    _state["live"] = enabled


def note(text: str) -> None:
    """A note on standard error (unless --quiet), where a pipe of the command's output does not take it."""
    if _state["live"]:
        errors.print(f"[yellow]note:[/] {text}")


def live() -> bool:
    return _state["live"] and console.is_terminal


def _fmt(key: str, v) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        if key == "lr":
            return f"{v:.2e}"
        if key == "mfu":
            return f"{100 * v:.1f}%"
        if key.endswith("_per_s"):  # a rate: whole units read best (tok_per_s, ex_per_s, img_per_s)
            return f"{v:,.1f}" if abs(v) < 100 else f"{v:,.0f}"
        return f"{v:.4f}" if abs(v) < 100 else f"{v:,.0f}"
    return str(v)


@contextlib.contextmanager
def phase(label: str, total: float | None = None, unit: str = ""):
    """A labelled spinner with the elapsed time while a slow step runs (reading data, training a
    tokenizer, tokenizing, evaluating...); with a known `total` (bytes, rows, batches) a bar with the
    share done and the time left. Yields advance(n) for the caller to report progress with. Output
    that is not a terminal gets a plain progress line every PIPED_EVERY_S seconds instead."""
    if not live():
        if total is None or not _state["live"]:
            yield lambda n=1: None
            return
        with _piped(label, total, unit) as advance:
            yield advance
        return
    training = _state["progress"]
    if training is not None:  # one live display at a time: a row under the training bar
        task = training.add_task(label, total=total, loss="")
        try:
            yield lambda n=1: training.advance(task, n)
        finally:
            training.remove_task(task)
        return
    columns = [SpinnerColumn(), TextColumn("{task.description}")]
    if total is not None:
        columns += [
            BarColumn(bar_width=24),
            TaskProgressColumn(),
            TextColumn(f"of {_amount(total, unit)}"),
            TextColumn("eta"),
            TimeRemainingColumn(compact=True),
        ]
    with Progress(*columns, TimeElapsedColumn(), console=console, transient=True) as progress:
        task = progress.add_task(label, total=total)
        yield lambda n=1: progress.advance(task, n)


@contextlib.contextmanager
def _piped(label: str, total: float, unit: str):
    """A phase's progress as plain lines (a log file, CI): one every PIPED_EVERY_S seconds, and the
    time it took once it printed any."""
    started = last = time.perf_counter()
    done, printed = 0.0, False

    def advance(n=1):
        nonlocal done, last, printed
        done += n
        now = time.perf_counter()
        if now - last >= PIPED_EVERY_S and 0 < done < total:
            left = (now - started) * (total - done) / done
            console.print(
                f"{label}: {done:,.0f} of {_amount(total, unit)} ({100 * done / total:.0f}%), eta {_eta(left)}"
            )
            last, printed = now, True

    yield advance
    if printed:
        console.print(f"{label}: {_amount(total, unit)} in {_eta(time.perf_counter() - started)}")


def counted(items, advance):
    """`items`, calling advance(1) as each is taken (a phase's progress over batches)."""
    for item in items:
        yield item
        advance(1)


def _amount(total: float, unit: str) -> str:
    """1,815 rows, 64 batches, 1.1 MB."""
    if unit == "bytes":
        return f"{total / 1e6:,.1f} MB" if total >= 1e5 else f"{total / 1e3:,.1f} kB"
    return f"{total:,.0f} {unit}".strip()


class TrainDisplay:
    """Rank 0's view of training: a bar that moves every step (step, loss, ETA; fits 80 columns) and
    a full log line (loss, lr, throughput, MFU, ...) at each log interval."""

    def __init__(self, total: int, start: int, enabled: bool = True):
        self.enabled = enabled
        self.total, self.start = total, start
        self.progress = (
            Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(bar_width=24),
                MofNCompleteColumn(),
                TextColumn("{task.fields[loss]}"),
                TextColumn("eta"),
                TimeRemainingColumn(compact=True),
                console=console,
                transient=False,
                speed_estimate_period=120,
            )
            if enabled and live()
            else None
        )

    def __enter__(self):
        if self.progress:
            self.progress.start()
            self.task = self.progress.add_task("train", total=self.total, completed=self.start, loss="")
            _state["progress"] = self.progress
        self.t0, self.done = time.perf_counter(), 0
        return self

    def __exit__(self, *exc):
        if self.progress:
            _state["progress"] = None
            self.progress.stop()

    def step(self, step: int, first: dict | None = None) -> None:
        """Every optimizer step: move the bar (the loss beside it is the last logged one: reading it
        every step would make the host wait for the device). `first`: a log window's first step's
        metrics, whose loss is read once while no line has given one yet, so that a run shorter than
        its log interval shows its loss from the first step."""
        if self.progress:
            self.progress.update(self.task, completed=step)
            if first is not None and "loss" in first and not self.progress.tasks[0].fields.get("loss"):
                self.progress.update(self.task, loss=f"loss {float(first['loss']):.4f}")

    def update(self, step: int, record: dict, eta_s: float) -> None:
        """At a log interval: the full line."""
        if not self.enabled:
            return
        keys = [k for k in record if k not in ("step", "elapsed_s", "split")]
        line = "  ".join(f"{k} {_fmt(k, record[k])}" for k in keys)
        console.print(f"step {step:>6}/{self.total}  {line}  eta {_eta(eta_s)}")
        if self.progress and "loss" in record:
            self.progress.update(self.task, loss=f"loss {record['loss']:.4f}")

    def note(self, step: int, split: str, metrics: dict) -> None:
        if self.enabled:
            body = "  ".join(f"{k} {_fmt(k, v)}" for k, v in metrics.items())
            console.print(f"[bold cyan]{split:>5}[/] step {step:>6}  {body}")


def _eta(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def plan_table(plan, title: str) -> None:
    """--dry-run's memory plan, a row per figure, then its one-line summary (what a run's header prints)."""
    from rich.table import Table

    table = Table(title=title, title_justify="left", show_header=False, box=None, pad_edge=False)
    table.add_column(style="dim")
    table.add_column(justify="right")
    for what, amount in plan.rows_table():
        table.add_row(what, f"[bold]{amount}[/]" if what == "planned peak" else amount)
    console.print(table)
    console.print(plan.summary())
