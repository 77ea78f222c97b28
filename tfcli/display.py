"""What a training run shows: a live progress bar on a terminal, plain log lines everywhere."""
from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

console = Console(highlight=False, soft_wrap=True)


def _fmt(key: str, v) -> str:
    if isinstance(v, float):
        if key == "lr":
            return f"{v:.2e}"
        if key == "mfu":
            return f"{100 * v:.1f}%"
        if key.endswith("_per_s"):  # a rate: whole units read best (tok_per_s, ex_per_s, img_per_s)
            return f"{v:,.1f}" if abs(v) < 100 else f"{v:,.0f}"
        return f"{v:.4f}" if abs(v) < 100 else f"{v:,.0f}"
    return str(v)


class TrainDisplay:
    """Rank 0's view of training: step, loss, lr, throughput, MFU, ETA."""

    def __init__(self, total: int, start: int, enabled: bool = True):
        self.enabled = enabled
        self.live = enabled and console.is_terminal
        self.progress = Progress(
            TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[status]}"), TimeRemainingColumn(), console=console, transient=False,
        ) if self.live else None
        self.total, self.start = total, start

    def __enter__(self):
        if self.progress:
            self.progress.start()
            self.task = self.progress.add_task("train", total=self.total, completed=self.start, status="")
        return self

    def __exit__(self, *exc):
        if self.progress:
            self.progress.stop()

    def update(self, step: int, record: dict, eta_s: float) -> None:
        if not self.enabled:
            return
        keys = [k for k in record if k not in ("step", "elapsed_s")]
        line = "  ".join(f"{k} {_fmt(k, record[k])}" for k in keys)
        if self.progress:
            self.progress.update(self.task, completed=step, status=line)
        console.print(f"step {step:>6}/{self.total}  {line}  eta {_eta(eta_s)}")

    def note(self, step: int, split: str, metrics: dict) -> None:
        if self.enabled:
            body = "  ".join(f"{k} {_fmt(k, v)}" for k, v in metrics.items())
            console.print(f"[bold cyan]{split:>5}[/] step {step:>6}  {body}")


def _eta(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"
