"""KTO (issue 73, part 2) step speed and memory against TRL's KTOTrainer: LoRA r16 on every block linear
of SmolLM2-135M-Instruct (its GGUF), the first HH harmless pairs split into a desirable and an
undesirable row each (TRL's unpaired format), 8 rows a step, 20 steps, the reference the base with
the adapters off on both sides, checkpointing off on both, each side in a fresh process. TRL reads the
rows in the order tfcli's sampler draws them, so both rotate the same completions for the KL estimate
within the same batches: per-step losses are compared as well as seconds per step (target 1.3x).

    python -m benchmarks kto
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path

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

STEPS, BATCH, PAIRS, LR, BETA = 20, 8, 160, 5e-4, 0.1


def rows_file(tmp: Path) -> Path:
    """The first HH pairs tfcli keeps at 512 tokens, each as two unpaired rows (chosen: desirable)."""
    from tfcli.data.preferences import PairFields, split_pair

    build = pair_builder()
    rows = []
    for line in HH.read_text().splitlines():
        pair = json.loads(line)
        if isinstance(build.pair(pair), str):
            continue
        prompt, chosen, rejected = split_pair(pair, PairFields())
        rows += [{"prompt": prompt, "completion": chosen, "label": True}]
        rows += [{"prompt": prompt, "completion": rejected, "label": False}]
        if len(rows) >= 2 * PAIRS:
            break
    (tmp / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp / "rows.jsonl"


def tfcli_args(data: Path) -> list[str]:
    args = ["finetune", "kto", "--from", str(gguf_file()), "--data", str(data), "--steps", str(STEPS)]
    args += ["--batch-size", str(BATCH), "--lr", str(LR), "--train", "lora", "--seed", str(SEED)]
    for s in ("finetune.warmup_fraction=0", "train.eval_interval=1000", "train.ckpt_interval=1000",
              "data.val_fraction=0.03", "adapter.rank=16", "adapter.alpha=32", f"kto.beta={BETA}"):  # fmt: skip
        args += ["--set", s]
    return args + settings_args(False)


def trl_rows(data: Path, tmp: Path) -> Path:
    """TRL's rows (prompt messages, the completion as an assistant message, the label) in tfcli's order."""
    from tfcli.data.chat import ChatTemplate
    from tfcli.data.conversations import DecoderExamples
    from tfcli.data.labelled import TextSpec, raw_splits
    from tfcli.engine.backbone import for_inference
    from tfcli.tasks.kto import KTOConfig, LabelledBatches, LabelledBuilder

    rows = raw_splits(TextSpec("kto", ()), str(data), "", 0.03, SEED)["train"][0]
    tok = for_inference(gguf_file()).tokenizer
    build = LabelledBuilder(DecoderExamples(tok, ChatTemplate(tok.chat_template), "last", 512), KTOConfig())
    labelled = build.build_all(rows).rows
    assert len(labelled) == len(rows)
    order = sampler_order(LabelledBatches(labelled, 0), BATCH, STEPS)
    (tmp / "same.json").write_text(json.dumps([rows[i] for i in order]))
    return tmp / "same.json"


def trl_main(rows_path: str, out: str) -> None:
    import datasets
    import peft
    import torch
    import transformers
    import trl

    torch.set_num_threads(2)
    plain = plain_copy(gguf_file(), Path(out).parent / "smollm2-hf")
    tokenizer = transformers.AutoTokenizer.from_pretrained(plain)
    model = transformers.AutoModelForCausalLM.from_pretrained(plain, dtype=torch.float32)
    rows = json.loads(Path(rows_path).read_text())
    dataset = datasets.Dataset.from_list(
        [
            {
                "prompt": r["prompt"],
                "completion": [{"role": "assistant", "content": r["completion"]}],
                "label": r["label"],
            }
            for r in rows
        ]
    )
    args = trl.KTOConfig(
        max_steps=STEPS, per_device_train_batch_size=BATCH, learning_rate=LR, beta=BETA, max_length=None,
        gradient_checkpointing=False, **trainer_args(out, SEED),
    )  # fmt: skip
    losses, times = [], []
    trainer = in_order(trl.KTOTrainer)(
        model=model,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=HF_TARGETS),
        callbacks=trl_callbacks(losses, times),
    )
    trainer.train()
    print(json.dumps({"loss": losses, "step_s": times, "peak_rss_mb": peak_rss_mb()}))


def main() -> None:
    if why := missing("kto"):
        print(why)
        return
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data = rows_file(tmp)
        ours = run_tfcli(tfcli_args(data), tmp / "tfcli")
        theirs = run_peer("benchmarks.kto", str(trl_rows(data, tmp)), str(tmp / "trl"))
        mine, peer = (statistics.median(r["step_s"][SKIP:]) for r in (ours, theirs))
        gaps = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(ours["loss"], theirs["loss"])]
        print(
            f"kto lora vs TRL KTOTrainer ({STEPS} steps x {BATCH} HH rows, checkpointing off both, medians after "
            f"{SKIP}): losses within {100 * max(gaps):.2f}% at every step (mean {100 * statistics.mean(gaps):.2f}%); "
            f"s/step tfcli {mine:.2f}, TRL {peer:.2f}: {peer / mine:.2f}x (target 1.3x); peak RSS tfcli "
            f"{ours['peak_rss_mb']:,.0f} MB, TRL {theirs['peak_rss_mb']:,.0f} MB"
        )


if __name__ == "__main__":
    if sys.argv[1:2] == ["trl"]:
        trl_main(*sys.argv[2:4])
    else:
        main()
