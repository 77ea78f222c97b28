"""Every `tfcli` command in the README's and the documentation's examples runs, from a directory outside the checkout with no
../shared beside it: built-in data and packaged assets as shipped, tiny local stand-ins where the
README names the user's own files (mnli/, my.csv, hf-bert/, ...), and a few steps instead of
thousands. Placeholders such as runs/<bert run> become the runs the earlier commands made."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from .conftest import REPO, invoke, tiny_npz

pytestmark = pytest.mark.slow  # the whole module is left out of the fast tier

KINDS = {
    "clm": "gpt",
    "mlm": "bert",
    "span": "t5",
    "mae": "mae",
    "electra": "electra",
    "igpt": "igpt",
    "image-classify": "probe",
}
TINY_PRETRAIN = [
    "--steps",
    "2",
    "--batch-size",
    "2",
    "--set",
    "train.log_interval=1",
    "--set",
    "train.eval_interval=2",
    "--set",
    "train.ckpt_interval=2",
    "--set",
    "train.eval_batches=1",
    "--set",
    "tokenizer.train_chars=200000",
    "--set",
    "tokenizer.vocab_size=600",
    "--quiet",
]
TINY_FINETUNE = [
    "--steps",
    "2",
    "--batch-size",
    "4",
    "--set",
    "finetune.eval_limit=6",
    "--set",
    "train.eval_interval=2",
    "--quiet",
]


DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def readme_commands() -> list[str]:
    """The tfcli (and torchrun) lines of the bash blocks of the README and every page of the docs,
    comments cut, each once."""
    text = "\n".join(path.read_text() for path in DOCUMENTS)
    lines = [
        line.split("  #")[0].strip()
        for block in re.findall(r"```bash\n(.*?)```", text, re.S)
        for line in block.splitlines()
    ]
    out = [
        re.sub(r"^\.venv/bin/", "", line)
        for line in lines
        if line.startswith(("tfcli ", ".venv/bin/tfcli ", "torchrun "))
    ]
    return list(dict.fromkeys(out))


def kind_of(run: Path) -> str:
    raw = yaml.safe_load((run / "config.yaml").read_text())
    if raw.get("objective"):
        return "llama" if raw["model"]["family"] == "llama" else KINDS[raw["objective"]]
    if raw.get("task") in ("sft", "dpo", "rm", "kto", "distill", "grpo"):
        return raw["task"]
    if raw.get("task") == "classify":
        return "mnli" if (raw.get("classify") or {}).get("preset") == "mnli" else "classify"
    return KINDS[raw["task"]]


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory, shared_data) -> Path:
    """A working directory far from the checkout, holding the user's files the README talks about."""
    root = tmp_path_factory.mktemp("user")
    assert not (root.parent / "shared").exists()
    mnli = root / "mnli"
    mnli.mkdir()
    for split, n in (("train", 64), ("dev_matched", 12), ("dev_mismatched", 12)):
        lines = (shared_data / "mnli" / f"{split}.jsonl").read_text().splitlines()[:n]
        (mnli / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    rows = [("great stuff", "loved it", "pos"), ("awful", "broke at once", "neg")] * 12
    (root / "my.csv").write_text("title,body,label\n" + "".join(f"{a},{b},{c}\n" for a, b, c in rows))
    shutil.copy(root / "my.csv", root / "reviews.csv")
    (root / "reviews.jsonl").write_text(
        "".join(json.dumps({"text": f"{a} {b}", "label": c}) + "\n" for a, b, c in rows)
    )
    (root / "data_dir").mkdir()
    for split in ("train", "dev"):
        (root / "data_dir" / f"{split}.csv").write_text(
            "question,label\n" + "".join(f"{a} {b}?,{c}\n" for a, b, c in rows)
        )
    sums = [{"prompt": f"What is {a} plus {b}?", "completion": f"It is {a + b}."} for a in range(6) for b in range(4)]
    (root / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sums))
    (root / "test.jsonl").write_text(
        "".join(json.dumps({**r, "question": r["prompt"], "answer": r["completion"]}) + "\n" for r in sums)
    )  # read by runs of either field naming
    (root / "qa.csv").write_text("question,answer\n" + "".join(f"{r['prompt']},{r['completion']}\n" for r in sums))
    (root / "chats.jsonl").write_text(
        "".join(
            json.dumps(
                {
                    "messages": [  # short: ChatML's markers are many tokens here
                        {"role": "user", "content": r["prompt"]},
                        {"role": "assistant", "content": r["completion"]},
                    ]
                }
            )
            + "\n"
            for r in sums
        )
    )
    products = [{"prompt": f"What is {a} times {b}?", "answer": str(a * b)} for a in (12, 34, 56) for b in (7, 8)]
    (root / "products.jsonl").write_text("".join(json.dumps(r) + "\n" for r in products))  # the tools guide's
    (root / "my_reward.py").write_text(  # the GRPO guide's own reward function
        "def brevity(prompts, completions, **columns):\n"
        "    return [1.0 if len(c.split()) <= 12 else 0.0 for c in completions]\n"
    )
    pairs = [{"prompt": r["prompt"], "chosen": r["completion"], "rejected": "I do not know."} for r in sums]
    (root / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in pairs))
    labelled = [  # the KTO guide's: each reply marked desirable or not
        {"prompt": p["prompt"], "completion": p["chosen" if i % 2 else "rejected"], "label": bool(i % 2)}
        for i, p in enumerate(pairs)
    ]
    (root / "labelled.jsonl").write_text("".join(json.dumps(r) + "\n" for r in labelled))
    (root / "hh.jsonl").write_text(
        "".join(
            json.dumps(
                {
                    "chosen": f"\n\nHuman: {r['prompt']}\n\nAssistant: {r['chosen']}",
                    "rejected": f"\n\nHuman: {r['prompt']}\n\nAssistant: No.",
                }
            )
            + "\n"
            for r in pairs
        )
    )
    (root / "gsm8k").mkdir()
    for split in ("train", "test"):
        (root / "gsm8k" / f"{split}.jsonl").write_text(
            "".join(
                json.dumps({"question": r["prompt"], "answer": f"{r['completion']}\n#### {r['completion'][6:-1]}"})
                + "\n"
                for r in sums
            )
        )
    (root / "piqa").mkdir()  # benchmarks: PIQA's and MMLU's own file layouts, a few rows each
    (root / "piqa" / "valid.jsonl").write_text(
        "".join(
            json.dumps({"goal": f"To add {a} and {b},", "sol1": "count on.", "sol2": "count back."}) + "\n"
            for a, b, _ in rows
        )
    )
    (root / "piqa" / "valid-labels.lst").write_text("0\n" * len(rows))
    (root / "bench").mkdir()  # a directory holding one directory per benchmark or task
    for name in ("piqa", "gsm8k"):
        (root / "bench" / name).symlink_to(root / name)
    from tfcli.hf.interop import export_gguf

    from .test_gguf import tiny_backbone  # stands in for the README's SmolLM2 GGUF (the same command)

    export_gguf(tiny_backbone(max_seq_len=512), None, root / "SmolLM2-135M-Instruct.Q4_1.gguf", "f32")
    from tfcli.bench.spec import load as load_benchmark

    for split in ("dev", "test"):
        (root / "mmlu" / split).mkdir(parents=True)
        for subject in load_benchmark("mmlu").subjects:
            (root / "mmlu" / split / f"{subject}_{split}.csv").write_text(
                "".join(f"What is {i} plus one?,{i + 1},{i},{i + 2},{i + 3},A\n" for i in range(5))
            )
    (root / "other.txt").write_text((shared_data / "text" / "tinyshakespeare.txt").read_text()[:20_000])
    (root / "my_texts").mkdir()
    (root / "my_texts" / "a.txt").write_text((shared_data / "text" / "war_and_peace.txt").read_text()[:60_000])
    (root / "my_texts" / "b.txt").write_text(
        (shared_data / "text" / "sherlock_holmes_complete.txt").read_text()[:60_000]
    )
    tiny_npz(root / "images.npz")
    shutil.copy(root / "images.npz", root / "cifar10_subset.npz")
    from PIL import Image

    for c in ("red", "blue"):
        (root / "my_images" / c).mkdir(parents=True)
        for i in range(6):
            pixel = (200, 20, 20) if c == "red" else (20, 20, 200)
            Image.new("RGB", (20, 20), pixel).save(root / "my_images" / c / f"{i}.png")
    import transformers

    transformers.BertModel(
        transformers.BertConfig(
            vocab_size=30522,
            hidden_size=32,
            num_hidden_layers=4,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=512,
        )
    ).save_pretrained(root / "hf-bert")
    shutil.copy(shared_data / "tokenizers" / "bert-base-uncased" / "vocab.txt", root / "hf-bert" / "vocab.txt")
    return root


def prepare(command: str, runs: dict[str, Path], n: int) -> list[str] | None:
    """The command as argv with placeholders filled and tiny settings added; None if a run it names
    does not exist yet."""
    for name in set(re.findall(r"runs/<([^>]+)>", command)):
        kind = {"run": "gpt", "any run": "gpt", "mnli run": "mnli", "probe run": "probe"}.get(name, name.split()[0])
        if kind not in runs:
            return None
        command = command.replace(f"runs/<{name}>", str(runs[kind]))
    argv = re.findall(r'"[^"]*"|\S+', command)
    argv = [a[1:-1] if a.startswith('"') else a for a in argv]
    argv = [f"out-{n}/" if a == "out/" else a for a in argv]
    if argv[0] == "torchrun":
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            *argv[1 : argv.index("-m")],
            "-m",
            "tfcli",
            *argv[argv.index("-m") + 2 :],
            *TINY_PRETRAIN,
        ]
    verb, extra = argv[1], []
    if argv[2:3] == ["grpo"]:  # sampling is most of a GRPO run: short completions, two per prompt
        extra = ["--set", "grpo.max_completion_length=16"] + ["--set", "grpo.num_generations=2"] * (verb == "finetune")
    if verb == "pretrain":
        extra = ["--steps", "4", "--quiet"] if "--resume" in argv else TINY_PRETRAIN
    elif verb == "finetune":
        extra += ["--quiet"] if "--resume" in argv else TINY_FINETUNE
    elif verb == "generate":
        extra = ["--max-new-tokens", "5"]
    elif verb == "compare":  # every cell a couple of steps (the last --budget wins)
        extra = ["--budget", "2steps", "--quiet"]
    return [sys.executable, "-m", "tfcli", *argv[1:], *extra]


def run_command(argv: list[str], cwd: Path, env: dict) -> tuple[int, str]:
    """A tfcli command in this process (CliRunner, cwd = the sandbox): importing torch and the rest
    again for each of ~80 commands cost half of this test's time; `compare`'s cells run here too (test_compare
    runs them in processes of their own). torchrun commands get a process."""
    if argv[1:3] == ["-m", "tfcli"]:
        from tfcli.commands import compare

        with pytest.MonkeyPatch.context() as mp:  # cwd and environment restored afterwards
            mp.chdir(cwd)
            for key, value in env.items():
                mp.setenv(key, value)
            mp.setattr(compare, "run_cell", cell_in_this_process)
            result = invoke(*argv[3:])
        return result.exit_code, result.output + (repr(result.exception) if result.exception else "")
    result = subprocess.run(
        argv, cwd=cwd, env={**os.environ, **env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600
    )
    return result.returncode, result.stdout[-2000:] + "\n" + result.stderr[-2000:]


def cell_in_this_process(cmd: list[str], log) -> tuple:
    """compare.run_cell's contract for a cell's `python -m tfcli ...` command, run by CliRunner: its
    output into the cell's log, its CPU seconds, no peak (this process's is not the cell's)."""
    from tfcli.commands import compare

    assert cmd[1:3] == ["-m", "tfcli"], cmd
    started = time.process_time()
    result = invoke(*cmd[3:])
    log.write(result.output + (repr(result.exception) if result.exception else ""))
    log.flush()
    return result.exit_code, compare.CellUsage(time.process_time() - started, 0.0, 0.0)


def test_every_documented_command_runs_outside_the_checkout(sandbox):
    commands = readme_commands()
    assert len(commands) > 35 and not [c for c in commands if "shared" in c]
    env = {"TFCLI_CACHE": str(sandbox / ".cache")}
    runs: dict[str, Path] = {}
    pending = list(enumerate(commands))
    for _ in range(3):  # a command naming a run that a later command makes waits for the next pass
        waiting = []
        for n, command in pending:
            argv = prepare(command, runs, n)
            if argv is None:
                waiting.append((n, command))
                continue
            before = set((sandbox / "runs").glob("*")) if (sandbox / "runs").is_dir() else set()
            code, output = run_command(argv, sandbox, env)
            assert code == 0, f"{command}\n{output[-4000:]}"
            for run in sorted(set((sandbox / "runs").glob("*")) - before):
                runs[kind_of(run)] = run
        pending = waiting
    assert not pending, f"never had the runs they name: {pending}"
