"""Shared fixtures: tiny recipes and real text from ../shared/data, sized for 2 CPU cores."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

torch.set_num_threads(2)

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "data"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED.is_dir():
        pytest.fail(f"{SHARED} is missing: tests need ../shared/data beside the checkout")
    return SHARED


@pytest.fixture(scope="session")
def small_text(tmp_path_factory, shared_data) -> Path:
    """The first 60k characters of Tiny Shakespeare."""
    path = tmp_path_factory.mktemp("text") / "shakespeare_head.txt"
    path.write_text((shared_data / "text" / "tinyshakespeare.txt").read_text()[:60_000])
    return path


def tiny_gpt_recipe(data: Path, **sections) -> dict:
    """A GPT recipe small enough to train for a few steps in a second or two."""
    raw = {
        "name": "tiny-gpt",
        "objective": "clm",
        "model": {"family": "gpt", "n_layer": 2, "n_head": 2, "d_model": 32, "d_ff": 64, "max_seq_len": 32},
        "tokenizer": {"kind": "char"},
        "data": {"source": str(data), "val_fraction": 0.1, "seq_len": 32},
        "optim": {"lr": 3e-3, "betas": [0.9, 0.99], "weight_decay": 0.1},
        "schedule": {"warmup_steps": 5, "decay": "cosine", "min_lr": 3e-4},
        "train": {"steps": 20, "batch_size": 8, "log_interval": 1, "eval_interval": 10, "eval_batches": 4,
                  "ckpt_interval": 10, "keep_checkpoints": 5, "seed": 7, "device": "cpu"},
    }
    for section, values in sections.items():
        raw.setdefault(section, {}).update(values) if isinstance(values, dict) else raw.__setitem__(section, values)
    return raw


@pytest.fixture
def write_recipe(tmp_path):
    """Write a recipe dict to a YAML file and return its path."""
    def write(raw: dict, name: str = "recipe.yaml") -> Path:
        path = tmp_path / name
        path.write_text(yaml.safe_dump(raw))
        return path
    return write


def read_metrics(run_dir: Path) -> list[dict]:
    import json

    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
