"""engine/checkpoint.py: a checkpoint is written whole or not at all; `latest` only ever names a whole one."""

from __future__ import annotations

import pytest

from tfcli import recipe as recipes
from tfcli.engine import checkpoint
from tfcli.errors import UserError

from .conftest import tiny_gpt_recipe
from .test_trainer import pretrain


def test_an_interrupted_checkpoint_write_never_becomes_latest(tmp_path, small_text, monkeypatch):
    rec = recipes.from_dict(tiny_gpt_recipe(small_text, train={"steps": 20, "ckpt_interval": 10}))
    calls = {"n": 0}
    original = checkpoint.save_file

    def failing_save(tensors, path):
        calls["n"] += path.endswith(checkpoint.WEIGHTS)
        # the second checkpoint dies halfway through its weights
        if calls["n"] == 2 and path.endswith(checkpoint.WEIGHTS):
            with open(path, "wb") as f:
                f.write(b"partial")
            raise OSError("disk full")
        return original(tensors, path)

    monkeypatch.setattr(checkpoint, "save_file", failing_save)
    with pytest.raises(
        UserError, match=r"could not write checkpoint step-0000020 .*disk full.*latest is still step-0000010"
    ):
        pretrain(rec, out=tmp_path / "run", quiet=True)
    assert checkpoint.find(tmp_path / "run").name == "step-0000010"
    assert not (tmp_path / "run" / "checkpoints" / "step-0000020").exists()
