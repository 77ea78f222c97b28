"""The GPU benchmark's harness, run end to end at tiny shapes on the CPU (`--smoke`): a real
`tfcli pretrain` process and transformers' model in a process of their own, rates and MFU read
back. It guards the harness that a lent GPU runs, so that a session with one only has to run it."""

from __future__ import annotations

import json

import pytest

from benchmarks import gpu


@pytest.mark.slow
def test_the_gpu_benchmark_harness_runs_whole_pretrain_steps_against_transformers(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu, "RESULTS", tmp_path)
    monkeypatch.setenv("NANOGPT", str(tmp_path / "no-nanoGPT"))
    [result] = gpu.main(smoke=True, names=("gpt",))
    for who in ("tfcli", "transformers"):
        assert result[who]["rate"] > 0, result[who]
        assert 0 < result[who]["mfu"] <= 1
        assert result[who]["peak_mem_mb"] > 0
    assert result["flops_per_item"] > 0
    assert "git clone https://github.com/karpathy/nanoGPT" in result["nanoGPT"]["error"]
    saved = json.loads((tmp_path / "results.jsonl").read_text().splitlines()[-1])
    assert saved["benchmark"] == "gpu gpt (smoke)" and saved["tfcli"]["rate"] == result["tfcli"]["rate"]


def test_the_cuda_peak_replay_finds_the_peak_and_what_was_live_there():
    """benchmarks/cuda_peak.py on a made-up allocator trace: the peak is the largest sum of live blocks
    (not the largest block, not the last moment), and the blocks live there are grouped by the tfcli
    frame that made them."""
    from benchmarks.cuda_peak import grouped, peak, where

    def alloc(addr, size, line):
        return {
            "action": "alloc",
            "addr": addr,
            "size": size,
            "frames": [
                {"filename": "/x/torch/nn/functional.py", "line": 1, "name": "linear"},
                {"filename": "/x/tfcli/models/blocks.py", "line": line, "name": "forward"},
            ],
        }

    def free(addr):
        return {"action": "free_completed", "addr": addr}

    trace = [alloc(1, 100, 10), alloc(2, 50, 20), free(1), alloc(3, 80, 20), alloc(4, 40, 10), free(3), free(2)]
    trace += [free(4), alloc(5, 160, 30), free(5)]  # the largest block, but alone: 160 < 50 + 80 + 40
    best, index, live = peak(trace)
    assert (best, index) == (170, 4)
    assert sorted(e["addr"] for e in live) == [2, 3, 4]
    assert where(live[0]) == "blocks.py:20:forward"
    assert grouped(live) == [("blocks.py:20:forward", 130, 2), ("blocks.py:10:forward", 40, 1)]
