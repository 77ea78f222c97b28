"""Pretraining throughput where users train (issue 13): whole `tfcli pretrain` steps (data, loop,
logging) against transformers' model of each family trained by a plain loop on the same shapes, and
GPT-2 124M against nanoGPT's train.py at the same batch.

    python -m benchmarks gpu                        # a CUDA machine: the four families
    python -m benchmarks.gpu --smoke                # tiny shapes on the CPU: the harness end to end
    NANOGPT=path/to/nanoGPT python -m benchmarks gpu   # default: bench-peers/nanoGPT, skipped if absent

Shapes are the shipped recipes' (GPT-2 small at context 1024, batch 12 = nanoGPT's; BERT-base MLM+NSP
at 128, batch 256; T5-small span corruption at 512, batch 128; ViT-B/16 MAE at 224 px, batch 64), one
optimizer step per micro-batch. bf16 autocast and torch.compile on every side. tfcli runs the real
command (built-in data, prefetch, metrics.jsonl) and its throughput is read from its own log lines
after the compile warm-up; transformers gets its batch already on the GPU. Every contender runs in a
process of its own. MFU: each family's training FLOPs per item (tfcli's count, the same shape for
every side) over the GPU's bf16 matmul peak measured here; peak memory: torch.cuda.max_memory_allocated
(tfcli.engine.perf.peak_memory_mb: the process's peak RSS on the CPU).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import RESULTS, ROOT, hf_peer, in_fresh_process
from tfcli import recipe as recipes
from tfcli.engine.perf import _measure, device_name, peak_memory_mb


def nanogpt_dir() -> Path:
    """A checkout of github.com/karpathy/nanoGPT: $NANOGPT, else bench-peers/nanoGPT (git-ignored)."""
    return Path(os.environ.get("NANOGPT", ROOT / "bench-peers" / "nanoGPT"))


@dataclass(frozen=True)
class Family:
    recipe: str
    label: str
    unit: str  # tok | img
    gpu: dict = field(default_factory=dict)  # recipe overrides for the benchmark
    smoke: dict = field(default_factory=dict)  # overrides making it tiny, for --smoke on the CPU


SMALL = {"model.n_layer": 2, "model.n_head": 2, "model.d_model": 64, "model.d_ff": 256}
FAMILIES = {
    "gpt": Family(
        "gpt2-small",
        "GPT-2 124M, context 1024, batch 12",
        "tok",
        {"train.batch_size": 12},
        {**SMALL, "model.max_seq_len": 64, "data.seq_len": 64, "train.batch_size": 4},
    ),
    "bert": Family(
        "bert-base",
        "BERT-base MLM+NSP, sequence 128, batch 256",
        "tok",
        {},
        {**SMALL, "train.batch_size": 8, "data.seq_len": 64},
    ),
    "t5": Family(
        "t5-small",
        "T5-small span corruption, inputs 512, batch 128",
        "tok",
        {"tokenizer.train_chars": 5_000_000},
        {
            **SMALL,
            "model.d_kv": 32,
            "model.n_decoder_layer": 2,
            "train.batch_size": 4,
            "data.seq_len": 64,
            "tokenizer.vocab_size": 1000,
            "model.vocab_size": 1000,
            "tokenizer.train_chars": 300_000,
        },
    ),
    "mae": Family(
        "vit-base-16",
        "ViT-B/16 MAE, 224 px, batch 64",
        "img",
        {},
        {
            **SMALL,
            "model.image_size": 32,
            "model.patch_size": 8,
            "model.decoder_d_model": 32,
            "model.decoder_n_layer": 1,
            "model.decoder_n_head": 2,
            "model.decoder_d_ff": 64,
            "train.batch_size": 8,
        },
    ),
}


@dataclass(frozen=True)
class Settings:
    device: str
    precision: str  # bf16 | fp32
    compile: bool
    warmup: int  # optimizer steps left out (compilation, allocator warm-up)
    steps: int  # optimizer steps timed
    log_interval: int

    @property
    def run_overrides(self) -> dict:
        return {
            "train.device": self.device,
            "train.precision": self.precision,
            "train.compile": "on" if self.compile else "off",
            "train.steps": self.warmup + self.steps,
            "train.grad_accum": 1,
            "train.log_interval": self.log_interval,
            "train.eval_interval": 10**9,
            "train.ckpt_interval": 10**9,
            "train.eval_batches": 1,
            "train.activation_checkpointing": "none",  # as the peers run (auto may recompute when activations dominate)
            "train.memory_limit": 0,
        }


GPU = Settings("cuda", "bf16", True, warmup=20, steps=60, log_interval=10)
SMOKE = Settings("cpu", "fp32", False, warmup=2, steps=4, log_interval=2)


def overrides(family: Family, settings: Settings, smoke: bool) -> dict:
    return {**family.gpu, **(family.smoke if smoke else {}), **settings.run_overrides}


def model_config(family: Family, over: dict):
    """The family's model config as the run resolves it (GPT-2's vocabulary comes from its tokenizer)."""
    cfg = recipes.load(family.recipe, {k: v for k, v in over.items() if k.startswith("model.")}).model
    return replace(cfg, vocab_size=50257) if getattr(cfg, "vocab_size", None) == 0 else cfg


def flops_per_item(name: str, cfg, recipe) -> float:
    """tfcli's training FLOPs per token/image for this shape (the objective's own count)."""
    from tfcli.models import bert, gpt, t5, vit
    from tfcli.objectives import mae, span_corruption

    with torch.device("meta"):
        if name in ("gpt", "bert"):
            return (gpt.GPT if name == "gpt" else bert.Bert)(cfg).flops_per_token(recipe.data.seq_len)
        if name == "t5":
            targets = span_corruption.compute_input_and_target_lengths(recipe.data.seq_len)[1]
            return t5.T5(cfg).flops_per_token(recipe.data.seq_len, targets)
        return mae.flops_per_image(vit.ViT(cfg), vit.MAEDecoder(cfg))


# ---- contenders: each runs in a process of its own and returns {"rate", "peak_mem_mb"} -------------


def run_tfcli(name: str, settings: Settings, smoke: bool) -> dict:
    """`tfcli pretrain` itself, as a user runs it; the rate is the median of its log windows after warm-up."""
    family = FAMILIES[name]
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "tfcli", "pretrain", "--recipe", family.recipe, "--out", f"{tmp}/run", "--quiet"]
        for k, v in overrides(family, settings, smoke).items():
            cmd += ["--set", f"{k}={v}"]
        logs = run_logged(cmd, Path(f"{tmp}/run"), settings.warmup + settings.steps, tmp)
    train = [m for m in logs if m["step"] > settings.warmup]
    rate = statistics.median(m[f"{family.unit}_per_s"] for m in train)
    return {"rate": rate, "peak_mem_mb": max(m["peak_mem_mb"] for m in train)}


def run_logged(cmd: list[str], run: Path, last_step: int, cwd: str | Path) -> list[dict]:
    """Run a tfcli training command until its metrics.jsonl logs `last_step`, then stop it (its final
    evaluation and checkpoint are not what is measured, and a 0.5B model's take many seconds of a
    lease) -> its train log lines. A command that ends first must end well."""
    metrics = run / "metrics.jsonl"

    def train_lines() -> list[dict]:
        text = metrics.read_text() if metrics.is_file() else ""
        lines = text.splitlines() if text.endswith("\n") else text.splitlines()[:-1]  # a line being written waits
        return [m for m in map(json.loads, lines) if m.get("split") == "train"]

    with tempfile.TemporaryFile("w+") as output:  # a file, not a pipe: a chatty run never blocks on it
        proc = subprocess.Popen(cmd, stdout=output, stderr=subprocess.STDOUT, text=True, cwd=cwd)
        while proc.poll() is None:
            if (logs := train_lines()) and logs[-1]["step"] >= last_step:
                proc.kill()
                proc.wait()
                return logs
            time.sleep(0.2)
        if proc.returncode:
            output.seek(0)
            raise RuntimeError(f"{' '.join(cmd[2:4])} failed: {output.read().strip()[-2000:]}")
    return train_lines()


def run_transformers(name: str, settings: Settings, smoke: bool) -> dict:
    """The family's transformers model, same shape, trained by a plain loop on one batch kept on the device."""
    import transformers

    family = FAMILIES[name]
    over = overrides(family, settings, smoke)
    recipe = recipes.load(family.recipe, over)
    cfg, device = model_config(family, over), torch.device(settings.device)
    peer, batch, loss_fn, items = _peer(name, cfg, recipe, transformers)
    peer = peer.to(device).train()
    batch = {k: v.to(device) for k, v in batch.items()}
    opt = torch.optim.AdamW([p for p in peer.parameters() if p.requires_grad], lr=1e-4, fused=True)
    forward = torch.compile(peer) if settings.compile else peer
    clip = recipe.train.clip_grad

    def step():
        with torch.autocast(device.type, torch.bfloat16, enabled=settings.precision == "bf16"):
            loss = loss_fn(forward, batch)
        loss.backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(peer.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return timed(step, settings.warmup, settings.steps, items, device)


def _peer(name: str, cfg, recipe, transformers):
    """(transformers model with tfcli's weights, a batch of the run's shape, loss(model, batch), items per
    step); the batches and losses are the CPU benchmarks' own, at the recipe's shape."""
    from benchmarks import bert, gpt, mae, t5
    from tfcli.models.bert import Bert
    from tfcli.models.gpt import GPT
    from tfcli.models.t5 import T5
    from tfcli.models.vit import MAEDecoder, ViT
    from tfcli.objectives import mlm_nsp

    b, seq = recipe.train.batch_size, recipe.data.seq_len
    torch.manual_seed(0)
    if name == "gpt":
        peer = hf_peer(transformers.GPT2LMHeadModel, GPT(cfg))
        return peer, {"input_ids": torch.randint(0, cfg.vocab_size, (b, seq))}, gpt.peer_loss, b * seq
    if name == "bert":
        peer = hf_peer(transformers.BertForPreTraining, Bert(cfg), mlm_nsp.build_heads(cfg).state_dict())
        return peer, bert.pretraining_batch(b, seq, cfg.vocab_size), bert.peer_loss, b * seq
    if name == "t5":
        batch = t5.span_batch(b, seq, 0, cfg.vocab_size)
        peer = hf_peer(transformers.T5ForConditionalGeneration, T5(cfg))
        return peer, batch, t5.peer_loss, batch["input_ids"].numel() + batch["labels"].numel()
    pixels = torch.randn(b, cfg.channels, cfg.image_size, cfg.image_size)
    peer = hf_peer(
        transformers.ViTMAEForPreTraining, ViT(cfg), torch.nn.ModuleDict({"decoder": MAEDecoder(cfg)}).state_dict()
    )
    return peer, {"pixels": pixels}, mae.peer_loss, b


def run_nanogpt(settings: Settings, smoke: bool) -> dict:
    """nanoGPT's train.py at GPT-2 124M's shape and tfcli's batch, on random GPT-2 token ids written as
    its data/<dataset>/train.bin; its own per-iteration times after the warm-up."""
    family = FAMILIES["gpt"]
    over = overrides(family, settings, smoke)
    cfg, recipe = model_config(family, over), recipes.load(family.recipe, over)
    b, seq, nanogpt = recipe.train.batch_size, recipe.data.seq_len, nanogpt_dir()
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data" / "bench"
        data.mkdir(parents=True)
        tokens = np.random.default_rng(0).integers(0, 50257, size=max(10**6, 4 * b * (seq + 1)), dtype=np.uint16)
        for split in ("train", "val"):
            tokens.tofile(data / f"{split}.bin")
        (Path(tmp) / "configurator.py").write_text((nanogpt / "configurator.py").read_text())
        args = dict(
            dataset="bench",
            out_dir=f"{tmp}/out",
            batch_size=b,
            block_size=seq,
            n_layer=cfg.n_layer,
            n_head=cfg.n_head,
            n_embd=cfg.d_model,
            dropout=0.0,
            bias=True,
            gradient_accumulation_steps=1,
            max_iters=settings.warmup + settings.steps,
            eval_interval=10**9,
            eval_iters=1,
            log_interval=1,
            always_save_checkpoint=False,
            wandb_log=False,
            device=settings.device,
            compile=settings.compile,
            dtype="bfloat16" if settings.precision == "bf16" else "float32",
        )
        runner = (
            "import atexit, runpy, sys, torch\n"
            f"sys.path.insert(0, {str(nanogpt)!r}); sys.argv = ['train.py'] + sys.argv[1:]\n"
            "from tfcli.engine.perf import peak_memory_mb\n"
            f"atexit.register(lambda: print('PEAK_MEM_MB', peak_memory_mb(torch.device({settings.device!r}))))\n"
            f"runpy.run_path({str(nanogpt / 'train.py')!r}, run_name='__main__')\n"
        )
        out = subprocess.run(
            [sys.executable, "-c", runner, *[f"--{k}={v}" for k, v in args.items()]],
            capture_output=True,
            text=True,
            cwd=tmp,
        )
        if out.returncode:
            raise RuntimeError(f"nanoGPT failed: {(out.stderr or out.stdout).strip()[-2000:]}")
    times = [
        float(line.split("time ")[1].split("ms")[0]) / 1e3
        for line in out.stdout.splitlines()
        if line.startswith("iter ") and int(line.split()[1].rstrip(":")) > settings.warmup
    ]
    peak = next(float(line.split()[1]) for line in out.stdout.splitlines() if line.startswith("PEAK_MEM_MB"))
    return {"rate": b * seq / statistics.median(times), "peak_mem_mb": peak}


def timed(step, warmup: int, steps: int, items: int, device: torch.device) -> dict:
    """`step` run `warmup` times, then timed over `steps` (the device drained at both ends) -> items/s
    and the process's peak memory."""
    for _ in range(warmup):
        step()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    sync(device)
    seconds = (time.perf_counter() - t0) / steps
    return {"rate": items / seconds, "peak_mem_mb": peak_memory_mb(device)}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---- the benchmark -------------------------------------------------------------------------------------


def contender(name: str, who: str, smoke: bool) -> dict:
    """One contender in a fresh process (so peak memory and compiled code are its own); a failure
    becomes the row's error."""
    try:
        return in_fresh_process("benchmarks.gpu", "--one", name, who, *(["--smoke"] if smoke else []))
    except RuntimeError as e:
        return {"error": str(e)}


def main(smoke: bool = False, names: tuple[str, ...] = tuple(FAMILIES)) -> list[dict]:
    settings = SMOKE if smoke else GPU
    if not smoke and not torch.cuda.is_available():
        print("gpu: no CUDA device here; skipped (python -m benchmarks.gpu --smoke checks the harness on the CPU)")
        return []
    device = torch.device(settings.device)
    dtype = torch.bfloat16 if settings.precision == "bf16" else torch.float32
    peak = _measure(device, dtype)
    print(
        f"gpu benchmark on {device_name(device)}: measured {settings.precision} matmul peak {peak / 1e12:.1f} TFLOP/s"
    )
    results = []
    for name in names:
        family = FAMILIES[name]
        over = overrides(family, settings, smoke)
        flops = flops_per_item(name, model_config(family, over), recipes.load(family.recipe, over))
        rows = {w: contender(name, w, smoke) for w in ("tfcli", "transformers")}
        if name == "gpt":
            found = (nanogpt_dir() / "train.py").is_file()
            rows["nanoGPT"] = (
                contender(name, "nanoGPT", smoke)
                if found
                else {
                    "error": f"not found at {nanogpt_dir()} (git clone https://github.com/karpathy/nanoGPT there, or set NANOGPT)"
                }
            )
        results.append(report(name, family, rows, flops, peak, device_name(device), settings))
    return results


def report(
    name: str, family: Family, rows: dict[str, dict], flops: float, peak: float, device: str, settings: Settings
) -> dict:
    print(f"{family.label if settings is GPU else name + ' (smoke shapes)'}:")
    ours = rows["tfcli"].get("rate")
    for who, r in rows.items():
        if "error" in r:
            print(f"  {who:13s} failed: {r['error']}")
            continue
        r["mfu"] = r["rate"] * flops / peak
        ratio = f", tfcli {ours / r['rate']:.2f}x" if who != "tfcli" and ours else ""
        print(
            f"  {who:13s} {r['rate']:>12,.0f} {family.unit}/s  MFU {100 * r['mfu']:5.1f}%  "
            f"peak memory {r['peak_mem_mb']:,.0f} MB{ratio}"
        )
    result = {
        "benchmark": f"gpu {name}" + (" (smoke)" if settings is SMOKE else ""),
        "device": device,
        "unit": f"{family.unit}/s",
        "flops_per_item": flops,
        "peak_flops": peak,
        **{who: {k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()} for who, r in rows.items()},
    }
    RESULTS.mkdir(exist_ok=True)
    with open(RESULTS / "results.jsonl", "a") as f:
        f.write(json.dumps(result) + "\n")
    return result


if __name__ == "__main__":
    args = sys.argv[1:]
    smoke = "--smoke" in args
    if smoke:
        torch.set_num_threads(2)
    if "--one" in args:
        name, who = args[args.index("--one") + 1 : args.index("--one") + 3]
        settings = SMOKE if smoke else GPU
        if who == "tfcli":
            result = run_tfcli(name, settings, smoke)
        elif who == "transformers":
            result = run_transformers(name, settings, smoke)
        else:
            result = run_nanogpt(settings, smoke)
        print(json.dumps(result))
    else:
        main(smoke, tuple(a for a in args if a in FAMILIES) or tuple(FAMILIES))
