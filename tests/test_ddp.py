"""Two processes under torchrun (gloo on CPU) train exactly like one at the same global batch."""
from __future__ import annotations

import os
import subprocess
import sys

import yaml

from .conftest import read_metrics, tiny_gpt_recipe


def run_tfcli(args, nproc: int):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    prefix = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"] \
        if nproc > 1 else [sys.executable]
    result = subprocess.run(prefix + ["-m", "tfcli", *map(str, args)], capture_output=True, text=True, env=env,
                            timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def test_two_process_ddp_matches_one_process_at_the_same_global_batch(tmp_path, small_text):
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(yaml.safe_dump(tiny_gpt_recipe(small_text, train={"steps": 8, "eval_interval": 8,
                                                                        "ckpt_interval": 8})))
    run_tfcli(["pretrain", "--recipe", recipe, "--out", tmp_path / "one", "--batch-size", 8, "--quiet"], nproc=1)
    two = run_tfcli(["pretrain", "--recipe", recipe, "--out", tmp_path / "two", "--batch-size", 4], nproc=2)
    one_log, two_log = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "two")
    assert [m["step"] for m in one_log] == [m["step"] for m in two_log]  # rank 0 alone logs
    for a, b in zip(one_log, two_log):
        assert abs(a["loss"] - b["loss"]) < 1e-5, (a, b)
    assert two.stdout.count("step      8/8") == 1  # and rank 0 alone prints
    assert sorted(p.name for p in (tmp_path / "two" / "checkpoints").iterdir()) == ["latest", "step-0000008"]
