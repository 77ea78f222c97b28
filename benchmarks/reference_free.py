"""The preference losses without a reference model (issue 73, part 3) against TRL's experimental
trainers, speed and memory: SimPO and CPO (`finetune dpo --set dpo.loss=simpo|cpo`, TRL's CPOTrainer with
loss_type simpo or sigmoid) and ORPO (`dpo.loss=orpo`, TRL's ORPOTrainer). The DPO benchmark's setting
(benchmarks/dpo.py): SmolLM2-135M-Instruct from its GGUF, the first HH harmless pairs that fit 512
tokens, LoRA r16 on every block linear, lr 5e-4, beta 0.1, batch 8 pairs, 20 steps, checkpointing off on
both sides, each side in a fresh process, TRL reading the pairs in the order tfcli's sampler draws them:
per-step losses are compared as well as seconds per step (target 1.3x) and peak RSS. A TRL run the
kernel kills (out of memory) is reported as such, with tfcli's side, and the next method runs.

    python -m benchmarks reference_free     (BENCH_REFFREE_METHODS=simpo,orpo,cpo picks; BENCH_STEPS;
                                             BENCH_REFFREE_BATCH pairs a step, default 8)
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from benchmarks.dpo import BETA, LR, data_file, pair_builder
from benchmarks.sft import HF_TARGETS, SEED, sampler_order
from benchmarks.smollm2 import gguf_file
from benchmarks.trl_peer import (
    SKIP,
    PeerKilled,
    checkpointing_ran,
    in_order,
    missing,
    peak_rss_mb,
    plain_copy,
    report,
    run_peer,
    run_tfcli,
    same_checkpointing,
    settings_args,
    trainer_args,
    trl_callbacks,
)

STEPS = int(os.environ.get("BENCH_STEPS", 20))
BATCH = int(os.environ.get("BENCH_REFFREE_BATCH", 8))
# each method: tfcli's settings and TRL's trainer with its config (TRL's defaults otherwise, as tfcli's)
METHODS = {
    "simpo": (["dpo.loss=simpo", "dpo.cpo_alpha=0"], "cpo", {"loss_type": "simpo", "cpo_alpha": 0.0}),
    "cpo": (["dpo.loss=cpo"], "cpo", {"loss_type": "sigmoid", "cpo_alpha": 1.0}),
    "orpo": (["dpo.loss=orpo"], "orpo", {}),
}


def methods() -> list[str]:
    wanted = os.environ.get("BENCH_REFFREE_METHODS", ",".join(METHODS))
    return [m.strip() for m in wanted.split(",") if m.strip()]


def same_order(data: Path, tmp: Path) -> Path:
    """TRL's rows ([prompt messages, chosen, rejected]) in the order tfcli's sampler draws them (its
    held-out share taken out first, as the run does)."""
    from tfcli.data.labelled import TextSpec, raw_splits
    from tfcli.data.preferences import PairFields, split_pair
    from tfcli.tasks.reply_batches import PairBatches

    rows = raw_splits(TextSpec("dpo", ()), str(data), "", 0.03, SEED)["train"][0]
    build = pair_builder()
    order = sampler_order(PairBatches([build.pair(r) for r in rows], 0), BATCH, STEPS)
    split = [split_pair(r, PairFields()) for r in rows]
    (tmp / "same.json").write_text(json.dumps([split[i] for i in order]))
    return tmp / "same.json"


def tfcli_args(data: Path, method: str) -> list[str]:
    args = ["finetune", "dpo", "--from", str(gguf_file()), "--data", str(data), "--steps", str(STEPS)]
    args += ["--batch-size", str(BATCH), "--lr", str(LR), "--train", "lora", "--seed", str(SEED)]
    for s in ("finetune.warmup_fraction=0", "train.eval_interval=1000", "train.ckpt_interval=1000",
              "data.val_fraction=0.03", "adapter.rank=16", "adapter.alpha=32", f"dpo.beta={BETA}",
              *METHODS[method][0]):  # fmt: skip
        args += ["--set", s]
    return args + settings_args(False)


def trl_main(method: str, rows_file: str, out: str) -> None:
    """One TRL run in this process (CPOTrainer or ORPOTrainer, LoRA, the pairs in tfcli's order); prints
    losses and step times as JSON."""
    import importlib

    import datasets
    import peft
    import torch
    import transformers

    torch.set_num_threads(2)
    _, module, settings = METHODS[method]
    experimental = importlib.import_module(f"trl.experimental.{module}")
    name = module.upper()
    plain = plain_copy(gguf_file(), Path(out).parent / "smollm2-hf")
    tokenizer = transformers.AutoTokenizer.from_pretrained(plain)
    model = transformers.AutoModelForCausalLM.from_pretrained(plain, dtype=torch.float32)
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
    args = getattr(experimental, f"{name}Config")(
        max_steps=STEPS, per_device_train_batch_size=BATCH, learning_rate=LR, beta=BETA,
        **settings, **trainer_args(out, SEED), gradient_checkpointing=False,
    )  # fmt: skip
    losses, times = [], []
    trainer = in_order(getattr(experimental, f"{name}Trainer"))(
        model=model,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=HF_TARGETS),
        callbacks=trl_callbacks(losses, times),
    )
    trainer.train()
    ran = checkpointing_ran(trainer)
    print(json.dumps({"loss": losses, "step_s": times, "peak_rss_mb": peak_rss_mb(), "checkpointing": ran}))


def main() -> None:
    if why := missing("reference_free"):
        print(why)
        return
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data = data_file(tmp)
        same = same_order(data, tmp)
        for method in methods():
            ours = run_tfcli(tfcli_args(data, method), tmp / f"tfcli-{method}")
            trainer = f"{METHODS[method][1].upper()}Trainer"
            try:
                theirs = run_peer("benchmarks.reference_free", method, str(same), str(tmp / f"trl-{method}"))
            except PeerKilled as e:
                print(
                    f"{method} lora vs TRL {trainer} ({STEPS} steps, b{BATCH} pairs): TRL's run was {e}; tfcli "
                    f"{statistics.median(ours['step_s'][SKIP:]):.2f} s/step, peak RSS {ours['peak_rss_mb']:,.0f} MB"
                )
                continue
            report(
                f"{method} lora vs TRL {trainer} ({STEPS} steps, b{BATCH} pairs, "
                f"{same_checkpointing(ours, theirs, False)})",
                ours,
                theirs,
                None,
                f"{BATCH} pairs",
            )


if __name__ == "__main__":
    if sys.argv[1:2] == ["trl"]:
        trl_main(*sys.argv[2:5])
    else:
        main()
