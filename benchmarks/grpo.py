"""GRPO speed against TRL's GRPOTrainer (issue 40): SmolLM2-135M-Instruct from its GGUF (both sides read
the same tensors), the same 2-digit addition prompts ("What is 47 + 28?", reward final-number), 4
prompts x 8 completions a step (TRL: per_device_train_batch_size 32, num_generations 8), completions
of at most 64 tokens at temperature 0.7, LoRA r 16 on every block linear (lr 1e-5), beta 0 and the dapo
loss (TRL's defaults), 2 threads, each side in a fresh process of its own, with gradient checkpointing
off on both sides and again on both (BENCH_CHECKPOINTING=off|on picks one).

Each step is timed whole and in its two parts: sampling (generation, rewards, advantages: tfcli's
`rollout_s` metric; TRL's _generate_and_score_completions, timed around the call) and the update (the
rest). The two sides sample different completions (different samplers), so their lengths differ from
step to step: each side's mean completion length is printed beside its times, and sampling is also
compared per generated token.

    python -m benchmarks grpo         (BENCH_STEPS, default 8; the first 2 are left out of the medians)

RLOO (issue 73, part 4): BENCH_GRPO_LOSS=rloo runs `grpo.loss_type=rloo` against TRL's RLOOTrainer,
both with RLOO's default KL weight (beta 0.05: the reference is the base with the adapters off on both
sides), the rest as above.

    BENCH_GRPO_LOSS=rloo python -m benchmarks grpo
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import RESULTS
from benchmarks.smollm2 import gguf_file
from benchmarks.trl_peer import (
    checkpointing_ran,
    checkpointing_settings,
    missing,
    peak_rss_mb,
    plain_copy,
    run_peer,
    same_checkpointing,
    tfcli_checkpointing,
    trainer_args,
)

STEPS, PROMPTS, G, LIMIT, TEMPERATURE, LR, SEED = int(os.environ.get("BENCH_STEPS", 8)), 4, 8, 64, 0.7, 1e-5, 1337
SKIP = 2
LOSS = os.environ.get("BENCH_GRPO_LOSS", "dapo")  # dapo (GRPO's TRL default) or rloo (TRL's RLOOTrainer)
RLOO_BETA = 0.05  # RLOOConfig's default KL weight
HF_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def prompts_file(tmp: Path) -> Path:
    r = random.Random(0)
    rows = []
    for _ in range(400):
        a, b = r.randint(10, 99), r.randint(10, 99)
        rows.append({"prompt": f"What is {a} + {b}?", "answer": str(a + b)})
    (tmp / "prompts.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rows))
    return tmp / "prompts.jsonl"


def tfcli_side(data: Path, out: Path, checkpointing: bool) -> dict:
    import subprocess

    args = [
        sys.executable, "-m", "tfcli", "finetune", "grpo", "--from", str(gguf_file()), "--data", str(data),
        "--reward", "final-number", "--train", "lora", "--steps", str(STEPS), "--batch-size", str(PROMPTS),
        "--lr", str(LR), "--seed", str(SEED), "--out", str(out), "--quiet",
        "--set", f"grpo.num_generations={G}", "--set", f"grpo.max_completion_length={LIMIT}",
        "--set", f"grpo.temperature={TEMPERATURE}", "--set", "grpo.eval_prompts=0", "--set", "data.seq_len=128",
        "--set", "train.log_interval=1", "--set", "train.threads=2", "--set", "finetune.report_limit=1",
        "--set", "train.eval_interval=1000", "--set", "train.ckpt_interval=1000", "--set", "adapter.rank=16",
        "--set", "adapter.alpha=32", "--set", f"train.activation_checkpointing={'blocks' if checkpointing else 'none'}",
        "--set", "train.memory_limit=0", "--set", f"grpo.loss_type={LOSS}",
    ]  # fmt: skip
    if LOSS == "rloo":
        args += ["--set", f"grpo.beta={RLOO_BETA}"]
    proc = subprocess.run(args, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"tfcli grpo: {(proc.stderr or proc.stdout).strip().splitlines()[-1]}")
    train = [m for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if m["split"] == "train"]
    ends = [m["elapsed_s"] for m in train]
    steps = [b - a for a, b in zip([0.0] + ends, ends)]
    return {
        "step_s": steps,
        "sampling_s": [m["rollout_s"] for m in train],
        "length": [m["completions/mean_length"] for m in train],
        "reward": [m["reward"] for m in train],
        "peak_rss_mb": max(m["peak_mem_mb"] for m in train),
        "checkpointing": tfcli_checkpointing(out),
    }


def trl_main(data: str, out: str, checkpointing: str) -> None:
    """One TRL run in this process; prints its step and sampling times as JSON."""
    import datasets
    import peft
    import torch
    import transformers
    import trl

    from tfcli.tasks.answers import correct

    torch.set_num_threads(2)
    plain = plain_copy(gguf_file(), Path(out).parent / "smollm2-hf")
    tokenizer = transformers.AutoTokenizer.from_pretrained(plain)
    model = transformers.AutoModelForCausalLM.from_pretrained(plain, dtype=torch.float32)
    rows = [json.loads(x) for x in Path(data).read_text().splitlines()]
    dataset = datasets.Dataset.from_list(
        [{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]} for r in rows]
    )

    def final_number(prompts, completions, answer, **kw):
        return [float(correct(c[0]["content"], a, "final-number")) for c, a in zip(completions, answer)]

    rloo = LOSS == "rloo"
    args = (trl.RLOOConfig if rloo else trl.GRPOConfig)(
        **({"beta": RLOO_BETA} if rloo else {"loss_type": LOSS}),
        max_steps=STEPS,
        per_device_train_batch_size=PROMPTS * G,
        num_generations=G,
        max_completion_length=LIMIT,
        temperature=TEMPERATURE,
        learning_rate=LR,
        **trainer_args(out, SEED),
        gradient_checkpointing=checkpointing == "on",  # TRL's default is on: set, as tfcli's side is
    )
    config = peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=HF_TARGETS)
    steps, sampling, lengths = [], [], []

    class Timed(trl.RLOOTrainer if rloo else trl.GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            t0 = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            sampling.append(time.perf_counter() - t0)
            lengths.append(self._metrics["train"]["completions/mean_length"][-1])
            return out

    class Clock(transformers.TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            steps.append(time.perf_counter() - self.t0)

    trainer = Timed(
        model=model,
        reward_funcs=[final_number],
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=config,
        callbacks=[Clock()],
    )
    trainer.train()
    print(
        json.dumps(
            {
                "step_s": steps,
                "sampling_s": sampling,
                "length": lengths,
                "peak_rss_mb": peak_rss_mb(),
                "checkpointing": checkpointing_ran(trainer),
            }
        )
    )


def median(xs: list[float]) -> float:
    return statistics.median(xs[min(SKIP, len(xs) - 1) :])


def main() -> None:
    if why := missing("grpo"):
        print(why)
        return
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data = prompts_file(tmp)
        for on in checkpointing_settings():
            setting = "on" if on else "off"
            ours = tfcli_side(data, tmp / f"tfcli-{setting}", on)
            theirs = run_peer("benchmarks.grpo", str(data), str(tmp / f"trl-{setting}"), setting)
            trainer = "RLOOTrainer" if LOSS == "rloo" else "GRPOTrainer"
            report(
                f"grpo ({LOSS}) LoRA vs TRL {trainer} ({STEPS} steps, {PROMPTS} prompts x {G}, {same_checkpointing(ours, theirs, on)})",
                ours,
                theirs,
            )


def report(name: str, ours: dict, theirs: dict, completions: int = PROMPTS * G) -> None:
    """Print and save each side's step, sampling and update seconds (`completions` sampled a step)."""
    row = {"benchmark": name, "date": time.strftime("%Y-%m-%d")}
    for side, run in (("tfcli", ours), ("trl", theirs)):
        step, sampling = median(run["step_s"]), median(run["sampling_s"])
        length = statistics.mean(run["length"][SKIP:] or run["length"])
        row.update(
            {
                f"{side}_s_per_step": step,
                f"{side}_sampling_s": sampling,
                f"{side}_update_s": step - sampling,
                f"{side}_mean_length": length,
                f"{side}_sampling_ms_per_token": 1000 * sampling / (completions * length),
                f"{side}_peak_rss_mb": run["peak_rss_mb"],
            }
        )
    row["ratio"] = row["trl_s_per_step"] / row["tfcli_s_per_step"]
    print(
        f"{name}: s/step tfcli {row['tfcli_s_per_step']:.2f} (sampling {row['tfcli_sampling_s']:.2f}, update "
        f"{row['tfcli_update_s']:.2f}, completions {row['tfcli_mean_length']:.1f} tokens), TRL "
        f"{row['trl_s_per_step']:.2f} (sampling {row['trl_sampling_s']:.2f}, update {row['trl_update_s']:.2f}, "
        f"completions {row['trl_mean_length']:.1f} tokens): {row['ratio']:.2f}x (target 1.3x); sampling "
        f"{row['tfcli_sampling_ms_per_token']:.2f} vs {row['trl_sampling_ms_per_token']:.2f} ms per completion "
        f"token; peak RSS tfcli {row['tfcli_peak_rss_mb']:,.0f} MB, TRL {row['trl_peak_rss_mb']:,.0f} MB"
    )
    RESULTS.mkdir(exist_ok=True)
    with open(RESULTS / "results.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    if sys.argv[1:2] == ["trl"]:
        trl_main(*sys.argv[2:5])
    else:
        main()
