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
