"""On-policy distillation (issue 73, part 5) against TRL's DistillationTrainer, speed and memory: a
LoRA student (r16 on every block linear) of SmolLM2-135M-Instruct from its GGUF, the teacher the same
model's weights in fp32 (both sides read the same dequantized tensors), the GRPO benchmark's 2-digit
addition prompts, 8 prompts a step, one sampled completion each of at most 64 tokens at TRL's
temperature 1, TRL's reverse KL (beta 1), checkpointing off on both sides, each side in a fresh process.
Each step is timed whole and in two parts, as the GRPO benchmark times it: sampling (tfcli's
`rollout_s`; TRL's `_generate_and_score_completions`, timed around the call) and the update (the rest:
the teacher's pass, the student's forward and backward, the optimizer). The two sides sample different
completions (each its own sampler), so each side's mean completion length is printed beside its
seconds, and sampling is also compared per completion token (the GRPO benchmark's report).

    python -m benchmarks distill       (BENCH_STEPS, default 8; the first 2 are left out of the medians)
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import ROOT
from benchmarks.grpo import HF_TARGETS, prompts_file, report
from benchmarks.lockstep import step_begins, step_ends
from benchmarks.smollm2 import gguf_file
from benchmarks.trl_peer import (
    checkpointing_ran,
    missing,
    peak_rss_mb,
    peer_env,
    plain_copy,
    run_peer,
    same_checkpointing,
    tfcli_checkpointing,
    trainer_args,
)

STEPS, PROMPTS, LIMIT, LR, SEED = int(os.environ.get("BENCH_STEPS", 8)), 8, 64, 1e-4, 1337
TURNS = os.environ.get("BENCH_TURNS", "1") != "0"  # 0: tfcli's run, then TRL's (before 2026-12-03)


def tfcli_args(data: Path, teacher: Path, out: Path) -> list[str]:
    return [
        "finetune", "distill", "--from", str(gguf_file()), "--teacher", str(teacher),
        "--data", str(data), "--train", "lora", "--steps", str(STEPS), "--batch-size", str(PROMPTS),
        "--lr", str(LR), "--seed", str(SEED), "--out", str(out), "--quiet",
        "--set", f"distill.max_completion_length={LIMIT}", "--set", "distill.lmbda=1", "--set", "distill.beta=1",
        "--set", "data.seq_len=128", "--set", "train.log_interval=1", "--set", "train.threads=2",
        "--set", "train.eval_interval=1000", "--set", "train.ckpt_interval=1000", "--set", "adapter.rank=16",
        "--set", "adapter.alpha=32", "--set", "train.activation_checkpointing=none", "--set", "train.memory_limit=0",
        "--set", "finetune.warmup_fraction=0",
    ]  # fmt: skip


def tfcli_read(out: Path) -> dict:
    """A finished tfcli run's steps (seconds from its metrics), sampling seconds, lengths, peak."""
    train = [m for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if m["split"] == "train"]
    ends = [m["elapsed_s"] for m in train]
    return {
        "step_s": [b - a for a, b in zip([0.0] + ends, ends)],
        "length": [m["completions/mean_length"] for m in train],
        "sampling_s": [m["rollout_s"] for m in train],
        "loss": [m["loss"] for m in train],
        "peak_rss_mb": max(m["peak_mem_mb"] for m in train),
        "checkpointing": tfcli_checkpointing(out),
    }


def tfcli_side(data: Path, teacher: Path, out: Path) -> dict:
    import subprocess

    proc = subprocess.run(
        [sys.executable, "-m", "tfcli", *tfcli_args(data, teacher, out)], capture_output=True, text=True
    )
    if proc.returncode:
        raise RuntimeError(f"tfcli distill: {(proc.stderr or proc.stdout).strip().splitlines()[-1]}")
    return tfcli_read(out)


def in_turns(data: Path, teacher: Path, tmp: Path) -> tuple[dict, dict]:
    """Both sides at once, one step of each in turn (benchmarks/lockstep.py), each step timed by the
    conductor from its go to its end."""
    from benchmarks import lockstep

    ours, theirs = lockstep.conduct(
        [
            [sys.executable, "-m", "benchmarks.lockstep", "tfcli", *tfcli_args(data, teacher, tmp / "tfcli")],
            [sys.executable, "-m", "benchmarks.distill", "trl", str(data), str(tmp / "trl")],
        ],
        [{**os.environ, "PYTHONPATH": str(ROOT)}, peer_env()],
        cwd=str(ROOT),
    )
    for name, side in (("tfcli distill", ours), ("TRL distill", theirs)):
        if side.proc.returncode:
            raise RuntimeError(f"{name}: {(side.stderr or side.stdout).strip().splitlines()[-1]}")
    return (
        {**tfcli_read(tmp / "tfcli"), "step_s": ours.step_s},
        {**json.loads(theirs.stdout.strip().splitlines()[-1]), "step_s": theirs.step_s},
    )


def trl_main(data: str, out: str) -> None:
    """One TRL run in this process; prints its step times and completion lengths as JSON."""
    import datasets
    import peft
    import torch
    import transformers
    import trl

    torch.set_num_threads(2)
    plain = plain_copy(gguf_file(), Path(out).parent / "smollm2-hf")
    tokenizer = transformers.AutoTokenizer.from_pretrained(plain)
    model = transformers.AutoModelForCausalLM.from_pretrained(plain, dtype=torch.float32)
    teacher = transformers.AutoModelForCausalLM.from_pretrained(plain, dtype=torch.float32)
    rows = [json.loads(x) for x in Path(data).read_text().splitlines()]
    dataset = datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}]} for r in rows])
    args = trl.DistillationConfig(
        max_steps=STEPS, per_device_train_batch_size=PROMPTS, max_completion_length=LIMIT, learning_rate=LR,
        beta=1.0, temperature=1.0, **trainer_args(out, SEED), gradient_checkpointing=False,
    )  # fmt: skip
    steps, lengths, losses, sampling = [], [], [], []

    class Timed(trl.DistillationTrainer):
        def _generate_and_score_completions(self, inputs):
            t0 = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            sampling.append(time.perf_counter() - t0)
            return out

    class Clock(transformers.TrainerCallback):
        def on_step_begin(self, *a, **k):
            step_begins()
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            steps.append(time.perf_counter() - self.t0)
            step_ends()

        def on_log(self, _args, _state, _control, logs=None, **k):
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))
                lengths.append(float(logs.get("completions/mean_length", float("nan"))))

    trainer = Timed(
        model=model,
        teacher_model=teacher,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=HF_TARGETS),
        callbacks=[Clock()],
    )
    trainer.train()
    ran = checkpointing_ran(trainer)
    print(
        json.dumps(
            {
                "step_s": steps,
                "sampling_s": sampling,
                "length": lengths,
                "loss": losses,
                "peak_rss_mb": peak_rss_mb(),
                "checkpointing": ran,
            }
        )
    )


def main() -> None:
    if why := missing("distill"):
        print(why)
        return
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data = prompts_file(tmp)
        teacher = plain_copy(gguf_file(), tmp / "smollm2-hf")
        if TURNS:
            ours, theirs = in_turns(data, teacher, tmp)
        else:
            ours = tfcli_side(data, teacher, tmp / "tfcli")
            theirs = run_peer("benchmarks.distill", str(data), str(tmp / "trl"))
        name = f"distill on-policy LoRA vs TRL DistillationTrainer ({STEPS} steps x {PROMPTS} prompts, " + (
            f"{'steps in turns' if TURNS else 'one side after the other'}, "
            + same_checkpointing(ours, theirs, False)
            + ")"
        )
        report(name, ours, theirs, PROMPTS)


if __name__ == "__main__":
    if sys.argv[1:2] == ["trl"]:
        trl_main(*sys.argv[2:4])
    else:
        main()
