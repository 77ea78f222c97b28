"""A multi-turn GRPO step with the calculator against TRL's GRPOTrainer(tools=...) (issue 72): the same
model (SmolLM2-135M-Instruct after a short SFT on calculator calls, so that it calls the tool: tfcli
trains it once, both sides start from its export), the same chat template (TRL's qwen2_5.jinja, whose
calls TRL's parser reads), the same multiplication prompts and reward (final-number of the last turn),
2 prompts x 8 completions, at most 128 tokens in all (turns and tool results), at most 2 tool rounds
(tfcli grpo.max_turns 3, TRL max_tool_calling_iterations 2), temperature 0.7, LoRA r 16 on every block
linear, gradient checkpointing off on both sides, 2 threads, each side in a fresh process.

Each side's step is timed whole and in its sampling part (tfcli's rollout_s, TRL's
_generate_and_score_completions), beside its calls per rollout and completion lengths (the two
samplers draw different completions).

    python -m benchmarks grpo_tools     (BENCH_STEPS, default 5; the first 2 are left out of the medians;
                                         BENCH_TOOL_FROM: a tfcli SFT run to start from instead)
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import RESULTS
from benchmarks.smollm2 import gguf_file
from benchmarks.trl_peer import missing, peak_rss_mb, run_peer, trainer_args

STEPS, PROMPTS, G, LIMIT, TEMPERATURE, LR, SEED = int(os.environ.get("BENCH_STEPS", 5)), 2, 8, 128, 0.7, 1e-5, 1337
TURNS, SKIP = 3, 2
HF_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def trl_template() -> Path:
    import trl

    return Path(trl.__file__).parent / "chat_templates" / "qwen2_5.jinja"


def tfcli(*args) -> None:
    proc = subprocess.run([sys.executable, "-m", "tfcli", *map(str, args)], capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"tfcli {' '.join(map(str, args[:2]))}: {(proc.stderr or proc.stdout).strip()[-600:]}")


def starting_model(tmp: Path) -> Path:
    """An HF directory both sides start from: a tfcli SFT run on calculator calls, exported."""
    from benchmarks.tool_use import files

    start = os.environ.get("BENCH_TOOL_FROM")
    if not start:
        demos = files(tmp)["demos"]
        tfcli("finetune", "sft", "--from", gguf_file(), "--data", demos, "--chat-template", trl_template(),
              "--steps", 20, "--batch-size", 8, "--lr", 5e-5, "--out", tmp / "sft", "--quiet", "--seed", SEED,
              "--set", "sft.generate_limit=0", "--set", "finetune.report_limit=1", "--set", "data.seq_len=512")  # fmt: skip
        start = tmp / "sft"
    tfcli("export", "--checkpoint", start, "--hf", tmp / "start")
    return tmp / "start"


def prompts_file(tmp: Path) -> Path:
    from benchmarks.tool_use import files

    return files(tmp)["prompts"]


def tfcli_side(start: Path, data: Path, out: Path) -> dict:
    tfcli(
        "finetune", "grpo", "--from", start, "--data", data, "--reward", "final-number", "--tools", "calculator",
        "--chat-template", trl_template(), "--train", "lora", "--steps", STEPS, "--batch-size", PROMPTS,
        "--lr", LR, "--seed", SEED, "--out", out, "--quiet",
        "--set", f"grpo.num_generations={G}", "--set", f"grpo.max_completion_length={LIMIT}",
        "--set", f"grpo.max_turns={TURNS}", "--set", f"grpo.temperature={TEMPERATURE}", "--set", "grpo.eval_prompts=0",
        "--set", "data.seq_len=512", "--set", "train.log_interval=1", "--set", "train.threads=2",
        "--set", "finetune.report_limit=1", "--set", "train.eval_interval=1000", "--set", "train.ckpt_interval=1000",
        "--set", "adapter.rank=16", "--set", "adapter.alpha=32", "--set", "train.activation_checkpointing=none",
        "--set", "train.memory_limit=0",
    )  # fmt: skip
    train = [m for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if m["split"] == "train"]
    ends = [m["elapsed_s"] for m in train]
    return {
        "step_s": [b - a for a, b in zip([0.0] + ends, ends)],
        "sampling_s": [m["rollout_s"] for m in train],
        "length": [m["completions/mean_length"] for m in train],
        "calls": [m["tools/call_frequency"] for m in train],
        "peak_rss_mb": max(m["peak_mem_mb"] for m in train),
    }


def trl_main(start: str, data: str, out: str) -> None:
    """One TRL run in this process; prints its step and sampling times as JSON."""
    import datasets
    import peft
    import torch
    import transformers
    import trl

    from tfcli.tasks.answers import correct
    from tfcli.tools.builtin import calculator

    torch.set_num_threads(2)
    tokenizer = transformers.AutoTokenizer.from_pretrained(start)
    tokenizer.chat_template = trl_template().read_text()
    model = transformers.AutoModelForCausalLM.from_pretrained(start, dtype=torch.float32)
    rows = [json.loads(x) for x in Path(data).read_text().splitlines()]
    dataset = datasets.Dataset.from_list(
        [{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]} for r in rows]
    )

    def final_number(prompts, completions, answer, **kw):
        return [float(correct(c[-1]["content"], a, "final-number")) for c, a in zip(completions, answer)]

    args = trl.GRPOConfig(
        max_steps=STEPS,
        per_device_train_batch_size=PROMPTS * G,
        num_generations=G,
        max_completion_length=LIMIT,
        max_tool_calling_iterations=TURNS - 1,
        temperature=TEMPERATURE,
        learning_rate=LR,
        **trainer_args(out, SEED),
        gradient_checkpointing=False,
    )
    config = peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=HF_TARGETS)
    steps, sampling, lengths, calls = [], [], [], []

    class Timed(trl.GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            t0 = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            sampling.append(time.perf_counter() - t0)
            lengths.append(self._metrics["train"]["completions/mean_length"][-1])
            calls.append(self._metrics["train"]["tools/call_frequency"][-1])
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
        tools=[calculator],
    )
    trainer.train()
    result = {"step_s": steps, "sampling_s": sampling, "length": lengths, "calls": calls}
    print(json.dumps({**result, "peak_rss_mb": peak_rss_mb()}))


def median(xs: list[float]) -> float:
    return statistics.median(xs[min(SKIP, len(xs) - 1) :])


def main() -> None:
    if why := missing("grpo_tools"):
        print(why)
        return
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        start = starting_model(tmp)
        data = prompts_file(tmp)
        ours = tfcli_side(start, data, tmp / "tfcli")
        theirs = run_peer("benchmarks.grpo_tools", str(start), str(data), str(tmp / "trl"))
    row = {"benchmark": f"grpo with the calculator vs TRL GRPOTrainer(tools=...) ({STEPS} steps)"}
    row["date"] = time.strftime("%Y-%m-%d")
    for side, run in (("tfcli", ours), ("trl", theirs)):
        step, sample = median(run["step_s"]), median(run["sampling_s"])
        row.update({f"{side}_s_per_step": step, f"{side}_sampling_s": sample, f"{side}_update_s": step - sample,
                    f"{side}_mean_length": statistics.mean(run["length"][SKIP:] or run["length"]),
                    f"{side}_calls": statistics.mean(run["calls"][SKIP:] or run["calls"]),
                    f"{side}_peak_rss_mb": run["peak_rss_mb"]})  # fmt: skip
    row["ratio"] = row["trl_s_per_step"] / row["tfcli_s_per_step"]
    print(
        f"{row['benchmark']}: s/step tfcli {row['tfcli_s_per_step']:.2f} (sampling {row['tfcli_sampling_s']:.2f}, "
        f"{row['tfcli_calls']:.2f} calls a rollout, {row['tfcli_mean_length']:.1f} tokens written), TRL "
        f"{row['trl_s_per_step']:.2f} (sampling {row['trl_sampling_s']:.2f}, {row['trl_calls']:.2f} calls, "
        f"{row['trl_mean_length']:.1f} tokens): {row['ratio']:.2f}x (target 1.3x); peak RSS tfcli "
        f"{row['tfcli_peak_rss_mb']:,.0f} MB, TRL {row['trl_peak_rss_mb']:,.0f} MB"
    )
    RESULTS.mkdir(exist_ok=True)
    with open(RESULTS / "results.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    if sys.argv[1:2] == ["trl"]:
        trl_main(*sys.argv[2:5])
    else:
        main()
