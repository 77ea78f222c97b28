"""The GPU benchmarks' harness, run end to end at tiny shapes on the CPU (`--smoke`): every contender
of the prepared lease (benchmarks/lease.py, with benchmarks/gpu.py's pretraining contenders) in a
process of its own, rates and MFU read back. It guards what a lent GPU runs, so that a session with
one only has to run it."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from benchmarks import lease

NANOGPT = Path(__file__).resolve().parents[1].parent / "shared" / "peers" / "nanoGPT"


@pytest.mark.slow
def test_the_lease_runs_every_kind_of_row_end_to_end_on_the_cpu(tmp_path, monkeypatch):
    """Issue 62's prepared GPU run at tiny shapes: the real `tfcli pretrain` against nanoGPT's own
    train.py and transformers (benchmarks/gpu.py's contenders), the real `tfcli finetune sft` against peft in a plain loop
    and TRL's SFTTrainer, tfcli's batched sampler against transformers' generate (the same greedy ids in
    fp32), the profile: each in a process of its own, read back into one table."""
    if not (NANOGPT / "train.py").is_file():
        pytest.skip(f"nanoGPT is not at {NANOGPT}")
    monkeypatch.setenv("NANOGPT", str(NANOGPT))
    only = ["gpt2", "sft-lora", "decode-b16", "profile"]
    rows = lease.main(tmp_path, smoke=True, only=only)
    assert [(r["section"], r["who"]) for r in rows] == [
        ("gpt2", "tfcli"),
        ("gpt2", "nanoGPT"),
        ("sft-lora", "tfcli"),
        ("sft-lora", "transformers+peft"),
        ("decode-b16", "tfcli"),
        ("decode-b16", "transformers"),
        ("profile", "tfcli"),
        ("sft-lora", "trl"),
        ("gpt2", "transformers"),
    ]
    assert not [r for r in rows if "error" in r or "skipped" in r], rows
    timed = [r for r in rows if r["section"] != "profile"]
    for r in timed:
        assert r["rate"] > 0 and r["peak_mem_mb"] > 0, r
        assert (0 < r["mfu"] <= 1) if r["section"] != "decode-b16" else "mfu" not in r, r
    table = (tmp_path / "table.md").read_text()
    assert "| sft-lora | trl |" in table and "| gpt2 | nanoGPT |" in table
    assert "decode-b16: leading greedy ids equal per row (of the first 8): [8, 8, 8]" in table  # fp32: equal
    saved = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert [s.get("rate") for s in saved] == [r.get("rate") for r in rows]
    profile = (tmp_path / "profile.txt").read_text()
    assert "tfcli SFT step" in profile and "greedy decoding" in profile and "host syncs" in profile
    assert (tmp_path / "log.txt").read_text().count("==== ") == len(rows)
    assert "torch " in (tmp_path / "versions.txt").read_text()


@pytest.mark.slow  # 6-13 s: the fast tier keeps under 3 minutes
def test_the_lease_lists_what_its_budget_left_out_and_stops_a_contender_at_its_time(tmp_path):
    """Rows that would start past the budget are listed as skipped (none started); a contender past its
    time is killed with everything it started, and its row says so."""
    rows = lease.main(tmp_path, smoke=True, budget=1)
    assert len(rows) == len(lease.PLAN) and all(r["skipped"].startswith("skipped: ") for r in rows)
    assert "| decode-b1 | transformers | skipped:" in (tmp_path / "table.md").read_text()
    work = tmp_path / "work"
    work.mkdir()
    lease.prepare(work, lease.SMOKE)
    t0 = time.perf_counter()
    result, _ = lease.contender("sft-full", "tfcli", work, lease.SMOKE, timeout=2)
    assert result == {"error": "stopped after 2 s (its time in the budget)"}
    assert time.perf_counter() - t0 < 10


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


def test_two_sides_in_lockstep_take_one_step_each_in_turn(tmp_path):
    """benchmarks/lockstep.py: the conductor lets one step of one side run while the other waits,
    then one of the other; a side with fewer steps ends and the other goes on alone; each side's
    steps are timed from its go to its end, and its output, return code and failure come back."""
    import sys

    from benchmarks import lockstep

    log = tmp_path / "log"
    side = (
        "import sys, time; from benchmarks.lockstep import step_begins, step_ends\n"
        "name, steps = sys.argv[1], int(sys.argv[2])\n"
        "for i in range(steps):\n"
        "    step_begins()\n"
        f"    open({str(log)!r}, 'a').write(f'{{name}}{{i}} ')\n"
        "    time.sleep(0.05)\n"
        "    step_ends()\n"
        "print('done', name)\n"
        "sys.exit(3 if name == 'C' else 0)\n"
    )
    root = str(Path(__file__).resolve().parents[1])
    argv = lambda name, steps: [sys.executable, "-c", side, name, str(steps)]  # noqa: E731
    a, b = lockstep.conduct([argv("A", 3), argv("B", 2)], cwd=root)
    assert log.read_text().split() == ["A0", "B0", "A1", "B1", "A2"]
    assert len(a.step_s) == 3 and len(b.step_s) == 2 and all(0.05 <= s < 1 for s in a.step_s + b.step_s)
    assert (a.stdout, b.stdout, a.proc.returncode) == ("done A\n", "done B\n", 0)
    (c,) = lockstep.conduct([argv("C", 1)], cwd=root)
    assert c.proc.returncode == 3 and c.step_s and c.stdout == "done C\n"
    lockstep.step_begins(), lockstep.step_ends()  # outside a conductor: nothing to wait for
