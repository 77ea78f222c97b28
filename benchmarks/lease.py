"""Issue 62: every GPU throughput figure in one prepared run, for a lent H100 or H200 (15 minutes of
device time in all, at most 10 per command): tfcli against nanoGPT, transformers (+ peft) and TRL, with
MFU against the bf16 matmul peak measured first, and `torch.cuda.max_memory_allocated`.

    make lease-pack                                   # here: nanoGPT and the peers' wheels, git-ignored
    python -m benchmarks.lease --out DIR              # there: 8.5 minutes at most (--budget seconds)
    python -m benchmarks lease                        # the same, into bench-results/lease
    python -m benchmarks.lease --smoke --out DIR      # here: the same rows at tiny shapes on the CPU

On the device tool (carry [".whl", "bench-peers"]; the machine has torch with CUDA, not trl or datasets; the
checkout runs in place, not installed):

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site
      .whl/*.whl && export PYTHONPATH=/tmp/site || exit; PYTHONUNBUFFERED=1 python3 -m benchmarks.lease
      --out $OUT 2>&1 | tee $OUT/console.txt

The rows (`--only` takes a row, or row/contender), most wanted first; a row that would start past the
budget is listed as skipped:
  gpt2        GPT-2 124M pretraining at context 1024, batch 12: `tfcli pretrain --recipe gpt2-small`
              against nanoGPT's own train.py, both compiled (benchmarks/gpu.py's contenders);
              gpt2/transformers, transformers' plain compiled loop, runs last
  sft-full    a Qwen2.5-0.5B-shaped decoder (random weights), batch 8 x 1024, every weight: the whole
  sft-lora    `tfcli finetune sft` command against transformers (+ peft: rank 16 on q k v o gate up
              down) in a plain loop on one batch kept on the GPU; eager on both sides; then
              sft-full/trl and sft-lora/trl, TRL's SFTTrainer (bf16, no gradient checkpointing)
  decode-b1   greedy decoding of 256 new tokens after a 64-token prompt, batch 1 and 16, bf16 weights
  decode-b16  on both sides: tfcli's sampler (`generate`'s, GRPO's) against transformers' `generate`
  profile     torch.profiler over tfcli's SFT step and its batch-1 decoding: the kernels and host syncs
  sft-full-compiled, sft-lora-compiled   the SFT pairs again with torch.compile on both sides

Every contender runs in a process of its own (its peak memory and compiled code are its own). bf16
autocast with fp32 weights for training on every side; tokens/s from the steps after the warm-up.
MFU: training FLOPs per token (tfcli's count: 6 N + attention; a LoRA step 4 N + attention, the
frozen weights getting no gradient) over the measured peak. What comes back (at most 8 files):
table.md (the table), rows.jsonl (every row as it finished), log.txt (each contender's output tail),
profile.txt, versions.txt.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from benchmarks.common import ROOT
from benchmarks.generation import greedy_ids
from benchmarks.gpu import run_logged, sync, timed


@dataclass(frozen=True)
class Shapes:
    """Everything a lease row's size depends on; GPU is the issue's, SMOKE runs in seconds on the CPU."""

    device: str
    precision: str  # bf16 | fp32 (autocast for training; the weights' dtype for decoding)
    qwen: dict  # the decoder's transformers config
    words: int  # the tokenizer's vocabulary of plain words (the model's vocabulary is larger)
    batch: int
    seq: int
    warmup: int  # optimizer steps left out of the rate
    steps: int  # optimizer steps timed
    log_interval: int
    prompt: int  # decoding: prompt tokens
    new: int  # decoding: new tokens
    wide: int  # decoding: the larger batch
    budget: float  # seconds for the whole run
    cap: float  # seconds for one contender


QWEN_05B = dict(  # Qwen2.5-0.5B's config.json, minus what only its checkpoint has
    model_type="qwen2",
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)
GPU = Shapes(
    device="cuda",
    precision="bf16",
    qwen=QWEN_05B,
    words=8000,
    batch=8,
    seq=1024,
    warmup=5,
    steps=20,
    log_interval=5,
    prompt=64,
    new=256,
    wide=16,
    budget=510.0,
    cap=170.0,
)
SMOKE = replace(
    GPU,
    device="cpu",
    precision="fp32",
    qwen=QWEN_05B
    | dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    | dict(num_key_value_heads=2, max_position_embeddings=256),
    words=400,
    batch=2,
    seq=32,
    warmup=1,
    steps=2,
    log_interval=1,
    prompt=8,
    new=8,
    wide=3,
    budget=600.0,
    cap=120.0,
)
OUT = ROOT / "bench-results" / "lease"
LORA = dict(rank=16, alpha=32, targets=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
PLAN = [
    ("gpt2", "tfcli"),
    ("gpt2", "nanoGPT"),
    ("sft-full", "tfcli"),
    ("sft-full", "transformers"),
    ("sft-lora", "tfcli"),
    ("sft-lora", "transformers+peft"),
    ("decode-b1", "tfcli"),
    ("decode-b1", "transformers"),
    ("decode-b16", "tfcli"),
    ("decode-b16", "transformers"),
    ("profile", "tfcli"),
    ("sft-full", "trl"),
    ("sft-lora", "trl"),
    ("sft-full-compiled", "tfcli"),
    ("sft-full-compiled", "transformers"),
    ("sft-lora-compiled", "tfcli"),
    ("sft-lora-compiled", "transformers+peft"),
    ("gpt2", "transformers"),
]


# ---- the model and data every SFT and decoding row reads -------------------------------------------------


def prepare(work: Path, shapes: Shapes) -> None:
    """work/model: the random decoder as a transformers directory with a word-level tokenizer (a word
    is a token, so a row of seq - 1 words is seq tokens with its end of text); work/data: text rows."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    model_dir, data = work / "model", work / "data"
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate(specials + [f"w{i}" for i in range(shapes.words)])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>", model_max_length=shapes.seq
    )
    fast.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    config = transformers.AutoConfig.for_model(**shapes.qwen, eos_token_id=0, pad_token_id=0, bos_token_id=0)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(model_dir)
    fast.save_pretrained(model_dir)
    rows = shapes.batch * (shapes.warmup + shapes.steps + 2)
    rng = torch.Generator().manual_seed(0)
    data.mkdir(parents=True)
    for split, n in (("train", rows), ("dev", 8)):
        words = torch.randint(len(specials), len(vocab), (n, shapes.seq - 1), generator=rng).tolist()
        lines = [json.dumps({"text": " ".join(f"w{i - len(specials)}" for i in row)}) for row in words]
        (data / f"{split}.jsonl").write_text("\n".join(lines) + "\n")


def token_batch(shapes: Shapes, device: torch.device) -> torch.Tensor:
    """(B, T) ids of plain words: what a text row of the data tokenizes to (without its end of text)."""
    g = torch.Generator().manual_seed(1)
    return torch.randint(3, 3 + shapes.words, (shapes.batch, shapes.seq), generator=g).to(device)


def sft_flops(work: Path, shapes: Shapes, lora: bool) -> float:
    """Training FLOPs per token of the decoder at the row's length: tfcli's 6 N + attention, or 4 N +
    attention for a LoRA step (no gradient for the frozen weights; the adapters' own are negligible)."""
    from tfcli.hf.interop import read_pretrained
    from tfcli.models import build_model

    cfg, _ = read_pretrained(work / "model", shapes_only=True)
    with torch.device("meta"):
        model = build_model(cfg)
    full, weights = model.flops_per_token(shapes.seq), model.flops_per_token(0)  # 6 N + attention; 6 N
    return full - weights / 3 if lora else full


# ---- contenders: each runs in a process of its own and prints {"rate", "peak_mem_mb", ...} ----------------


def tfcli_sft(work: Path, shapes: Shapes, lora: bool, compiled: bool) -> dict:
    """The whole `tfcli finetune sft` command, as a user runs it (stopped once it logged the last timed
    step); the rate is the timed steps' tokens over their seconds in its own log."""
    out = work / f"run-{'lora' if lora else 'full'}-{'c' if compiled else 'e'}"
    sets = {
        "sft.format": "text",
        "data.seq_len": shapes.seq,
        "train.device": shapes.device,
        "train.precision": shapes.precision,
        "train.compile": "on" if compiled else "off",
        "train.activation_checkpointing": "none",
        "train.memory_limit": 0,
        "train.log_interval": shapes.log_interval,
        "train.eval_interval": 10**9,
        "train.ckpt_interval": 10**9,
        "finetune.warmup_fraction": 0,
        "finetune.report_limit": 8,
        "sft.generate_limit": 0,
        "adapter.rank": LORA["rank"],
        "adapter.alpha": LORA["alpha"],
    }
    cmd = [
        sys.executable,
        "-m",
        "tfcli",
        "finetune",
        "sft",
        "--from",
        str(work / "model"),
        "--data",
        str(work / "data"),
    ]
    cmd += ["--train", "lora" if lora else "all", "--steps", str(shapes.warmup + shapes.steps)]
    cmd += ["--batch-size", str(shapes.batch), "--out", str(out), "--quiet"]
    for k, v in sets.items():
        cmd += ["--set", f"{k}={v}"]
    train = run_logged(cmd, out, shapes.warmup + shapes.steps, ROOT)
    first, last = next(m for m in train if m["step"] >= shapes.warmup), train[-1]
    seconds = last["elapsed_s"] - first["elapsed_s"]  # the timed steps, from the warm-up's last log line
    rate = (last["step"] - first["step"]) * shapes.batch * shapes.seq / seconds
    return {"rate": rate, "peak_mem_mb": max(m["peak_mem_mb"] for m in train)}


def peer_model(work: Path, shapes: Shapes, lora: bool, device: torch.device):
    """transformers' model of the directory, fp32 weights on the device (+ peft's LoRA)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(work / "model", dtype=torch.float32).to(device)
    if lora:
        import peft

        model = peft.get_peft_model(model, lora_config())
    return model.train()


def lora_config():
    """peft's LoraConfig for tfcli's adapters (LORA): what the peer and TRL are given alike."""
    import peft

    return peft.LoraConfig(r=LORA["rank"], lora_alpha=LORA["alpha"], lora_dropout=0.0, target_modules=LORA["targets"])


def transformers_sft(work: Path, shapes: Shapes, lora: bool, compiled: bool) -> dict:
    """transformers (+ peft) in a plain loop: bf16 autocast, fused AdamW, clipping at 1.0 as tfcli's
    recipe clips, labels = inputs (every token a target, as a text row is), one batch on the device."""
    device = torch.device(shapes.device)
    model = peer_model(work, shapes, lora, device)
    ids = token_batch(shapes, device)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5, fused=device.type == "cuda")
    forward = torch.compile(model) if compiled else model

    def step():
        with torch.autocast(device.type, torch.bfloat16, enabled=shapes.precision == "bf16"):
            loss = forward(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return timed(step, shapes.warmup, shapes.steps, ids.numel(), device)


def trl_sft(work: Path, shapes: Shapes, lora: bool) -> dict:
    """TRL's SFTTrainer on the same rows, already tokenized (each seq tokens), bf16, no gradient
    checkpointing (TRL's default is on; tfcli's rows run without); the median step after the warm-up."""
    import datasets
    import transformers
    import trl

    from benchmarks.trl_peer import trainer_args, trl_callbacks

    device = torch.device(shapes.device)
    tokenizer = transformers.AutoTokenizer.from_pretrained(work / "model")
    ids = token_batch(shapes, torch.device("cpu"))
    rows = [{"input_ids": ids[i % shapes.batch].tolist()} for i in range(shapes.batch * (shapes.warmup + shapes.steps))]
    settings = trainer_args(str(work / f"trl-{'lora' if lora else 'full'}"), 0)
    settings |= {"use_cpu": device.type == "cpu", "bf16": shapes.precision == "bf16"}
    args = trl.SFTConfig(
        max_steps=shapes.warmup + shapes.steps,
        per_device_train_batch_size=shapes.batch,
        learning_rate=1e-5,
        max_length=shapes.seq,
        packing=False,
        gradient_checkpointing=False,
        **settings,
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(work / "model", dtype=torch.float32)
    losses, times = [], []
    trainer = trl.SFTTrainer(
        model=model,
        args=args,
        train_dataset=datasets.Dataset.from_list(rows),
        processing_class=tokenizer,
        peft_config=lora_config() if lora else None,
        callbacks=trl_callbacks(losses, times),
    )
    trainer.train()
    from tfcli.engine.perf import peak_memory_mb

    step = statistics.median(times[shapes.warmup :])
    return {"rate": shapes.batch * shapes.seq / step, "peak_mem_mb": peak_memory_mb(device)}


def prompts(shapes: Shapes, rows: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(2)
    return torch.randint(3, 3 + shapes.words, (rows, shapes.prompt), generator=g)


def decode_model(work: Path, shapes: Shapes, device: torch.device, ours: bool):
    """The decoder in the row's dtype on the device: tfcli's (read as `generate` reads it) or transformers'."""
    dtype = torch.bfloat16 if shapes.precision == "bf16" else torch.float32
    if ours:
        from tfcli.engine.backbone import for_inference

        return for_inference(work / "model").model.to(device=device, dtype=dtype).eval()
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(work / "model", dtype=dtype).to(device).eval()


def decode(work: Path, shapes: Shapes, rows: int, ours: bool) -> dict:
    """Greedy decoding of exactly `new` tokens per row (no stop): a short warm-up generation, then the
    median of three. tfcli: generate_tokens at batch 1 (`tfcli generate`), generate_batch above it."""
    from tfcli.generate import generate_batch, generate_tokens

    device = torch.device(shapes.device)
    model, prompt = decode_model(work, shapes, device, ours), prompts(shapes, rows).to(device)

    @torch.no_grad()
    def run(new: int) -> list[list[int]]:
        if ours and rows == 1:
            return [list(generate_tokens(model, prompt, max_new_tokens=new, temperature=0.0))]
        if ours:
            return generate_batch(model, prompt.tolist(), max_new_tokens=new, temperature=0.0)
        return greedy_ids(model, prompt, new, shapes.prompt)

    run(max(8, shapes.new // 8))  # warm-up: CUDA's kernels and the allocator's blocks
    seconds, ids = [], []
    for _ in range(3):
        sync(device)
        t0 = time.perf_counter()
        ids = run(shapes.new)
        sync(device)
        seconds.append(time.perf_counter() - t0)
    from tfcli.engine.perf import peak_memory_mb

    rate = rows * shapes.new / statistics.median(seconds)
    return {"rate": rate, "peak_mem_mb": peak_memory_mb(device), "ids": [row[:64] for row in ids]}


def profile(work: Path, shapes: Shapes) -> dict:
    """torch.profiler over three of tfcli's SFT steps (its model, fused loss and AdamW, eager) and 16
    tokens of its batch-1 decoding: the kernels by time and the host syncs, into profile.txt."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    from tfcli.engine.backbone import for_inference
    from tfcli.generate import generate_tokens
    from tfcli.objectives.next_token import loss

    device = torch.device(shapes.device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    model = for_inference(work / "model").model.to(device).train()
    ids = token_batch(shapes, device)
    batch = {"input_ids": ids[:, :-1], "targets": ids[:, 1:]}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")

    def step():
        with torch.autocast(device.type, torch.bfloat16, enabled=shapes.precision == "bf16"):
            value = loss(model, None, batch)[0]
        value.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(2):
        step()
    sync(device)
    text = []
    with profiler(activities=activities) as prof:
        for _ in range(3):
            step()
        sync(device)
    text += [f"== tfcli SFT step (full, eager), 3 steps of {tuple(ids.shape)} ==", summary(prof, sort)]
    model = decode_model(work, shapes, device, ours=True)
    prompt = prompts(shapes, 1).to(device)
    list(generate_tokens(model, prompt, max_new_tokens=4, temperature=0.0))
    with profiler(activities=activities) as prof:
        list(generate_tokens(model, prompt, max_new_tokens=16, temperature=0.0))
        sync(device)
    text += ["== tfcli greedy decoding, batch 1, 16 tokens ==", summary(prof, sort)]
    (work / "profile.txt").write_text("\n".join(text) + "\n")
    return {"profile": str(work / "profile.txt")}


def summary(prof, sort: str) -> str:
    """The top operators by self time, and how often the host waited on the device."""
    averages = prof.key_averages()
    syncs = {e.key: e.count for e in averages if e.key in ("aten::item", "aten::_local_scalar_dense")}
    syncs |= {e.key: e.count for e in averages if "Synchronize" in e.key}
    return averages.table(sort_by=sort, row_limit=30) + f"\nhost syncs: {syncs}\n"


def gpt2(who: str, shapes: Shapes) -> dict:
    """benchmarks/gpu.py's contenders: the real `tfcli pretrain`, nanoGPT's train.py, transformers' loop."""
    from benchmarks import gpu

    smoke = shapes.device == "cpu"
    settings = gpu.SMOKE if smoke else gpu.GPU
    if who == "tfcli":
        return gpu.run_tfcli("gpt", settings, smoke)
    if who == "nanoGPT":
        if not (gpu.nanogpt_dir() / "train.py").is_file():
            raise RuntimeError(f"nanoGPT not found at {gpu.nanogpt_dir()} (make lease-pack copies it there)")
        return gpu.run_nanogpt(settings, smoke)
    return gpu.run_transformers("gpt", settings, smoke)


def one(section: str, who: str, work: Path, shapes: Shapes) -> dict:
    """Contender `who` of row `section`, in this process."""
    compiled = section.endswith("-compiled")
    lora = section.startswith("sft-lora")
    if section == "gpt2":
        return gpt2(who, shapes)
    if section.startswith("sft"):
        if who == "tfcli":
            return tfcli_sft(work, shapes, lora, compiled)
        if who == "trl":
            return trl_sft(work, shapes, lora)
        return transformers_sft(work, shapes, lora, compiled)
    if section.startswith("decode"):
        return decode(work, shapes, 1 if section == "decode-b1" else shapes.wide, who == "tfcli")
    return profile(work, shapes)


# ---- the run: contenders in turn, each in a process of its own, within the budget ----------------------


def flops_of(section: str, work: Path, shapes: Shapes) -> float | None:
    """Training FLOPs per token of a row's shape (None for decoding and the profile)."""
    if section == "gpt2":
        from benchmarks import gpu

        smoke = shapes.device == "cpu"
        over = gpu.overrides(gpu.FAMILIES["gpt"], gpu.SMOKE if smoke else gpu.GPU, smoke)
        from tfcli import recipe as recipes

        return gpu.flops_per_item("gpt", gpu.model_config(gpu.FAMILIES["gpt"], over), recipes.load("gpt2-small", over))
    if section.startswith("sft"):
        return sft_flops(work, shapes, section.startswith("sft-lora"))
    return None


def contender(section: str, who: str, work: Path, shapes: Shapes, timeout: float) -> tuple[dict, str]:
    """One contender in a fresh process group (killed whole at the timeout: tfcli and nanoGPT start
    processes of their own) -> (its result or {"error"}, the tail of what it printed)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    args = [sys.executable, "-m", "benchmarks.lease", "--one", section, who, "--work", str(work)]
    proc = subprocess.Popen(
        args + (["--smoke"] if shapes.device == "cpu" else []) + ["--precision", shapes.precision],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return {"error": f"stopped after {timeout:.0f} s (its time in the budget)"}, (out + err)[-3000:]
    tail = (out + err)[-3000:]
    if proc.returncode:
        lines = (err or out).strip().splitlines() or ["(no output)"]
        return {"error": lines[-1][:400]}, tail
    try:
        return json.loads(out.strip().splitlines()[-1]), tail
    except (IndexError, ValueError):  # a run the lease cannot read is a row's error, not the lease's end
        return {"error": f"no result line in its output: {out.strip()[-200:]!r}"}, tail


def versions() -> str:
    import importlib.metadata as metadata

    names = ["torch", "transformers", "peft", "trl", "datasets", "accelerate", "tokenizers", "pyarrow", "triton"]
    found = []
    for name in names:
        try:
            found.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            found.append(f"{name} absent")
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return f"{device}; python {sys.version.split()[0]}; " + ", ".join(found)


def table(rows: list[dict], device: str, peak: float) -> str:
    """The results as a markdown table: each row's contenders, tfcli's ratio to each peer."""
    lines = [
        f"GPU throughput, {device}, measured matmul peak {peak / 1e12:.2f} TFLOP/s, {time.strftime('%Y-%m-%d')}",
        "",
        "| row | contender | tokens/s | MFU | peak memory | tfcli vs it |",
        "|---|---|---|---|---|---|",
    ]
    ours = {r["section"]: r["rate"] for r in rows if r["who"] == "tfcli" and "rate" in r}
    for r in rows:
        if "error" in r or "skipped" in r:
            lines.append(f"| {r['section']} | {r['who']} | {r.get('error') or r['skipped']} | | | |")
            continue
        if "rate" not in r:
            continue
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") else ""
        ratio = f"{ours[r['section']] / r['rate']:.2f}x" if r["who"] != "tfcli" and r["section"] in ours else ""
        lines.append(
            f"| {r['section']} | {r['who']} | {r['rate']:,.0f} | {mfu} | {r['peak_mem_mb']:,.0f} MB | {ratio} |"
        )
    return "\n".join(lines) + "\n"


def agreement(rows: list[dict]) -> list[str]:
    """Where both sides decoded: how many leading greedy ids agree (fp32 on the CPU: all; bf16 drifts)."""
    notes = []
    for section in ("decode-b1", "decode-b16"):
        ids = {r["who"]: r["ids"] for r in rows if r["section"] == section and "ids" in r}
        if len(ids) == 2:
            a, b = ids.values()
            same = [next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), len(p)) for p, q in zip(a, b)]
            notes.append(f"{section}: leading greedy ids equal per row (of the first {len(a[0])}): {same}")
    return notes


def main(
    out: Path = OUT,
    smoke: bool = False,
    budget: float | None = None,
    only: list[str] | None = None,
    precision: str | None = None,
) -> list[dict]:
    """Every row of PLAN (or those `only` names: a row, or row/contender) within `budget` seconds."""
    started = time.perf_counter()
    shapes = replace(SMOKE if smoke else GPU, **({"precision": precision} if precision else {}))
    budget = budget or shapes.budget
    if not smoke and not torch.cuda.is_available():
        raise SystemExit("lease: no CUDA device here (python -m benchmarks.lease --smoke runs the rows on the CPU)")
    from tfcli.engine.perf import _measure, device_name

    out.mkdir(parents=True, exist_ok=True)
    device = torch.device(shapes.device)
    peak = _measure(device, torch.bfloat16 if shapes.precision == "bf16" else torch.float32)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the contenders' processes share the GPU with this one
    (out / "versions.txt").write_text(versions() + "\n")
    work = Path(tempfile.mkdtemp(prefix="tfcli-lease-"))
    prepare(work, shapes)
    print(f"lease on {device_name(device)}: peak {peak / 1e12:.1f} TFLOP/s; {versions()}", flush=True)
    rows: list[dict] = []
    log = out / "log.txt"
    for section, who in PLAN:
        if only and section not in only and f"{section}/{who}" not in only:
            continue
        left = budget - (time.perf_counter() - started)
        if left < 20:
            row = {"section": section, "who": who, "skipped": f"skipped: {max(left, 0):.0f} s of the budget left"}
        else:
            t0 = time.perf_counter()
            result, tail = contender(section, who, work, shapes, min(left, shapes.cap))
            row = {"section": section, "who": who, **result, "seconds": round(time.perf_counter() - t0, 1)}
            if "rate" in row and (flops := flops_of(section, work, shapes)):
                row["mfu"] = row["rate"] * flops / peak  # tfcli's count: a failure here is a bug to see
            with open(log, "a") as f:
                f.write(f"==== {section} / {who} ({row['seconds']} s) ====\n{tail}\n")
        if "profile" in row:
            (out / "profile.txt").write_text(Path(row.pop("profile")).read_text())
        rows.append(row)
        with open(out / "rows.jsonl", "a") as f:
            f.write(json.dumps({**row, "device": device_name(device), "shapes": asdict(shapes)}) + "\n")
        (out / "table.md").write_text(table(rows, device_name(device), peak) + "\n".join(agreement(rows)) + "\n")
        print(f"{section} / {who}: " + json.dumps({k: v for k, v in row.items() if k != "ids"}), flush=True)
    print((out / "table.md").read_text())
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--budget", type=float, default=None)
    parser.add_argument("--only", default="", help="rows (or row/contender), comma-separated: gpt2,sft-lora/trl")
    parser.add_argument("--precision", choices=["bf16", "fp32"], help="default: bf16 on the GPU, fp32 on the CPU")
    parser.add_argument("--one", nargs=2)
    parser.add_argument("--work", type=Path)
    a = parser.parse_args()
    if a.smoke:
        torch.set_num_threads(2)
    if a.one:
        shapes = SMOKE if a.smoke else GPU
        print(json.dumps(one(*a.one, a.work, replace(shapes, precision=a.precision or shapes.precision))))
    else:
        main(a.out, a.smoke, a.budget, [s for s in a.only.split(",") if s] or None, a.precision)
