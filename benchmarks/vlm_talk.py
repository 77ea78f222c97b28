"""A pretrained ViT taught to talk: the features of one MAE-pretrained ViT used two ways on CIFAR-10.

1. MAE pretraining of mae-vit-tiny on the CIFAR-10 subset (../shared/data/images/cifar10_subset).
2. llama-mini pretrained on the built-in text (the decoder).
3. The two composed into a LLaVA-style model (`finetune sft --from LLAMA --vision-from MAE`, a fresh
   projector, the tower frozen) and trained on "What is in this picture?" -> the class name, on the
   subset's 10,000 training images written as PNG files; the held-out score is the share of the 1,000
   test images whose generated reply is exactly the class name.
4. The image-classify head (a linear probe of the mean-pooled features) on the same frozen ViT with the
   same budget: the same steps and images per step.
Chance is 10%. Prints the results page's table.

    python -m benchmarks vlm_talk
    BENCH_VLM_DIR=/tmp/talk BENCH_VLM_STEPS=400 BENCH_VLM_MAE_STEPS=800 python -m benchmarks vlm_talk

Runs already in the directory are read, not trained again.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from benchmarks.common import ROOT

NPZ = ROOT.parent / "shared" / "data" / "images" / "cifar10_subset" / "cifar10_subset.npz"
DIRECTORY = Path(os.environ.get("BENCH_VLM_DIR", Path(tempfile.gettempdir()) / "tfcli-vlm-talk"))
STEPS = int(os.environ.get("BENCH_VLM_STEPS", 400))
MAE_STEPS = int(os.environ.get("BENCH_VLM_MAE_STEPS", 800))
TEXT_STEPS = int(os.environ.get("BENCH_VLM_TEXT_STEPS", 600))
BATCH = int(os.environ.get("BENCH_VLM_BATCH", 32))
QUESTION = "What is in this picture?"


def tfcli(*args) -> None:
    subprocess.run([sys.executable, "-m", "tfcli", *map(str, args), "--quiet"], check=True, cwd=ROOT)


def once(out: Path, *args) -> Path:
    if not (out / "checkpoints" / "latest").is_file():
        tfcli(*args, "--out", out)
    return out


def image_rows() -> Path:
    """The subset as PNG files and sft rows: train.jsonl (10,000) and test.jsonl (1,000)."""
    from PIL import Image

    data = DIRECTORY / "rows"
    if (data / "test.jsonl").is_file():
        return data
    pictures = np.load(NPZ)
    names = [str(n) for n in pictures["class_names"]]
    for split in ("train", "test"):
        (data / split).mkdir(parents=True, exist_ok=True)
        lines = []
        for i, (image, label) in enumerate(zip(pictures[f"x_{split}"], pictures[f"y_{split}"])):
            Image.fromarray(image).save(data / split / f"{i}.png")
            lines.append({"image": f"{split}/{i}.png", "prompt": f"<image>{QUESTION}", "completion": names[label]})
        (data / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return data


def main() -> None:
    DIRECTORY.mkdir(parents=True, exist_ok=True)
    mae = once(DIRECTORY / "mae", "pretrain", "--objective", "mae", "--data", NPZ, "--steps", MAE_STEPS)
    text = once(DIRECTORY / "llama", "pretrain", "--objective", "clm", "--recipe", "llama-mini", "--steps", TEXT_STEPS)
    data = image_rows()
    budget = ["--steps", STEPS, "--batch-size", BATCH]
    talk = once(
        DIRECTORY / "talk",
        *("finetune", "sft", "--from", text, "--vision-from", mae, "--data", data, *budget),
        *("--set", "sft.chat_template=none", "--set", "sft.max_new_tokens=8", "--set", "sft.generate_limit=0"),
        *("--set", "optim.lr=1e-3", "--set", "train.eval_interval=100"),
    )
    report = talk / "eval-test.json"  # every test image's reply generated (8 tokens: "automobile" takes 5)
    if not report.is_file():
        tfcli(
            "eval",
            "sft",
            "--checkpoint",
            talk,
            "--data",
            data / "test.jsonl",
            "--out",
            report,
            "--set",
            "sft.max_new_tokens=8",
        )
    head = once(
        DIRECTORY / "head",
        *("finetune", "image-classify", "--from", mae, "--data", NPZ, "--train", "head", *budget),
    )
    spoken = json.loads(report.read_text())
    probed = json.loads((head / "eval.json").read_text())
    print(json.dumps({"talk": spoken, "head": probed}, indent=1))


if __name__ == "__main__":
    main()
