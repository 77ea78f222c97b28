"""Where a run's metrics go: metrics.jsonl always; a CSV table, TensorBoard and Weights & Biases when
`train.loggers` names them, each through its own library. Every row carries its split ("train",
"val", "skipped") and its step.
"""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

from ..errors import UserError

LOGGERS = ("csv", "tensorboard", "wandb")
EXTRAS = {
    "tensorboard": ("tensorboard", "pip install 'tfcli[tensorboard]'"),
    "wandb": ("wandb", "pip install 'tfcli[wandb]'"),
}


def check_available(names: tuple[str, ...]) -> None:
    """The libraries the loggers need are installed (checked before a run writes anything)."""
    import importlib.util

    for name in names:
        module, how = EXTRAS.get(name, (None, ""))
        if module and importlib.util.find_spec(module) is None:
            raise UserError(f"train.loggers: {name} needs the {module} package ({how})")


class MetricsLog:
    """Rank 0's metrics sink for one run."""

    def __init__(self, run_dir: Path, names: tuple[str, ...], run_name: str, config: dict | None = None):
        self.run_dir, self.names, self.run_name, self.config = Path(run_dir), names, run_name, config
        self._csv_rows: list[dict] | None = None
        self._tb = self._wandb = None

    def write(self, record: dict) -> None:
        with open(self.run_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        if "csv" in self.names:
            self._write_csv(record)
        if "tensorboard" in self.names:
            self._write_tensorboard(record)
        if "wandb" in self.names:
            self._write_wandb(record)

    def _write_csv(self, record: dict) -> None:
        """metrics.csv, one column per metric; rewritten whole when a new column appears."""
        path = self.run_dir / "metrics.csv"
        if self._csv_rows is None:
            self._csv_rows = list(csv.DictReader(open(path))) if path.is_file() else []
        columns = list(dict.fromkeys(k for r in self._csv_rows for k in r))
        self._csv_rows.append(record)
        new = [k for k in record if k not in columns]
        if new or not path.is_file():
            with open(path, "w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=columns + new)
                writer.writeheader()
                writer.writerows(self._csv_rows)
        else:
            with open(path, "a", newline="") as f:
                csv.DictWriter(f, fieldnames=columns).writerow(record)

    def _write_tensorboard(self, record: dict) -> None:
        if self._tb is None:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.run_dir / "tensorboard"))
        split = record.get("split", "train")
        for k, v in record.items():
            if isinstance(v, (int, float)) and k != "step":
                self._tb.add_scalar(f"{split}/{k}", v, record["step"])
        self._tb.flush()

    def _write_wandb(self, record: dict) -> None:
        if self._wandb is None:
            import wandb

            self._wandb = wandb.init(
                project=os.environ.get("WANDB_PROJECT", "tfcli"),
                name=self.run_name,
                dir=str(self.run_dir),
                config=self.config,
                resume="allow",
                mode=os.environ.get("WANDB_MODE", "offline"),
            )
        split = record.get("split", "train")
        self._wandb.log(
            {f"{split}/{k}": v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"},
            step=record["step"],
        )

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
