"""Vision-language models (issue 61): a LoRA SFT step of a LLaVA-shaped model, tfcli against
transformers + peft on the same random weights (one transformers directory both sides read), the same
batch, the same threads, fp32, each contender in a fresh process of its own; and the memory plan of a
`tfcli finetune sft --train lora` run of it against the peak the run measured.

  The model: LLaVA's shape cut to what this machine trains: a CLIP ViT-B/32 tower at 224 px (12 layers,
  d 768; 49 patches and [CLS], the hidden state before the last read, the [CLS] dropped), LLaVA's
  two-layer GELU projector, and SmolLM2-135M's decoder shape (30 layers, d 576, 9 heads over 3
  key/value heads) over GPT-2's tokenizer with <image> added.
  Step: batch BENCH_VLM_BATCH (4) rows of 49 image tokens and 143 text tokens, the last 32 trained; LoRA
  rank 16 on the decoder's q, k, v, o, gate, up, down (the tower frozen, the projector trained whole:
  LLaVA's LoRA recipe; peft: the same modules by regex, the projector left trainable).

Target: tfcli >= 1.3x transformers + peft's tokens/s; the memory plan within 15% of the measured peak.

    python -m benchmarks vlm
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks.common import ROOT, Contenders, isolated, report, train_step

BATCH, IMAGE, TEXT, TRAINED = int(os.environ.get("BENCH_VLM_BATCH", 4)), 49, 143, 32
TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
DIRECTORY = Path(os.environ.get("BENCH_VLM_MODEL_DIR", Path(tempfile.gettempdir()) / "tfcli-bench-vlm"))
TOWER = dict(
    model_type="clip_vision_model",
    hidden_size=768,
    intermediate_size=3072,
    num_hidden_layers=12,
    num_attention_heads=12,
    image_size=224,
    patch_size=32,
)
DECODER = dict(
    model_type="llama",
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
)


def directory() -> Path:
    """The random LLaVA-shaped model with its tokenizer and CLIP processor (written once, then reused)."""
    import transformers
    from tokenizers import AddedToken

    from tfcli.data.chat import ChatTemplate
    from tfcli.data.tokenizers import load_tokenizer_files

    if not (DIRECTORY / "preprocessor_config.json").is_file():
        tok = load_tokenizer_files("builtin:gpt2", ["<|endoftext|>"])
        tok.tok.add_special_tokens(
            [AddedToken(t, special=True, normalized=False) for t in ("<|im_start|>", "<|im_end|>", "<image>")]
        )
        config = transformers.LlavaConfig(
            text_config={**DECODER, "vocab_size": tok.vocab_size},
            vision_config=TOWER,
            image_token_id=tok.token_id("<image>"),
            vision_feature_layer=-2,
        )
        torch.manual_seed(0)
        transformers.LlavaForConditionalGeneration(config).save_pretrained(DIRECTORY)
        transformers.CLIPImageProcessorPil().save_pretrained(DIRECTORY)
        tok.tok.save(str(DIRECTORY / "tokenizer.json"))
        template = ChatTemplate.load("chatml").source
        (DIRECTORY / "tokenizer_config.json").write_text(
            json.dumps({"eos_token": "<|im_end|>", "chat_template": template})
        )
    return DIRECTORY


def batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids (B, T) with the image's tokens after the first, pixel values (B, 3, 224, 224), labels)."""
    g = torch.Generator().manual_seed(0)
    image_id = json.loads((directory() / "config.json").read_text())["image_token_index"]  # on disk
    text = torch.randint(0, 50000, (BATCH, TEXT), generator=g)
    ids = torch.cat([text[:, :1], torch.full((BATCH, IMAGE), image_id), text[:, 1:]], dim=1)
    labels = ids.clone()
    labels[:, : ids.size(1) - TRAINED] = -100
    return ids, torch.randn(BATCH, 3, 224, 224, generator=g), labels


def _ours_step():
    from tfcli import adapters
    from tfcli.engine.backbone import for_inference
    from tfcli.recipe import AdapterConfig
    from tfcli.tasks.reply_batches import decoder_loss

    model = for_inference(directory()).model.train()
    adapters.apply(model, "lora", AdapterConfig(rank=16, alpha=32, dropout=0.0, targets=TARGETS))
    ids, pixels, labels = batch()
    targets = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)
    b = {"input_ids": ids, "targets": targets, "pixel_values": pixels}
    params = [p for p in model.parameters() if p.requires_grad]
    return train_step(
        lambda: decoder_loss(model, torch.nn.ModuleDict(), b)[0], torch.optim.AdamW(params, lr=1e-4, fused=True)
    )


def _their_step():
    import peft
    import transformers

    model = transformers.AutoModelForImageTextToText.from_pretrained(directory())
    names = "|".join(f"{p}_proj" for p in ("q", "k", "v", "o", "gate", "up", "down"))
    config = peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=rf".*language_model.*\.({names})")
    model = peft.get_peft_model(model, config).train()
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name or ".multi_modal_projector." in name)
    ids, pixels, labels = batch()
    params = [p for p in model.parameters() if p.requires_grad]
    return train_step(
        lambda: model(input_ids=ids, pixel_values=pixels, labels=labels).loss,
        torch.optim.AdamW(params, lr=1e-4, fused=True),
    )


def lora() -> Contenders:
    return {"tfcli": _ours_step, "transformers": _their_step}


def memory_plan() -> tuple[float, float]:
    """(planned, measured) peak MB of `tfcli finetune sft --train lora` on this model: 3 steps of 16 rows,
    each a 320x240 image, a question and a reply (129 tokens; data.seq_len 130, so that the plan, which
    holds for the longest row the data may have, plans for these)."""
    import numpy as np
    from PIL import Image

    data = Path(tempfile.mkdtemp())
    rows = []
    for i in range(64):
        Image.fromarray(np.random.default_rng(i).integers(0, 255, (240, 320, 3), dtype=np.uint8)).save(
            data / f"{i}.png"
        )
        rows.append(
            {"image": f"{i}.png", "prompt": "<image>" + "What is in this picture? " * 8, "completion": "noise " * 20}
        )
    (data / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["finetune", "sft", "--from", str(directory()), "--data", str(data / "rows.jsonl"), "--train", "lora"]
    args += ["--steps", "3", "--batch-size", "16", "--out", str(data / "run"), "--set", "sft.generate_limit=0"]
    args += [
        "--set",
        "data.val_fraction=0.25",
        "--set",
        "train.activation_checkpointing=none",
        "--set",
        "data.seq_len=130",
    ]
    out = subprocess.run([sys.executable, "-m", "tfcli", *args], capture_output=True, text=True, cwd=ROOT)
    line = next((x for x in out.stdout.splitlines() if x.startswith("peak memory:")), None)
    if line is None:
        raise SystemExit(f"vlm memory plan: the run failed: {(out.stderr or out.stdout).strip().splitlines()[-1:]}")
    (measured, unit_m), (planned, unit_p) = re.findall(r"([\d.]+) (MB|GB)", line)[:2]
    scale = {"MB": 1.0, "GB": 1000.0}
    return float(planned) * scale[unit_p], float(measured) * scale[unit_m]


def main() -> None:
    torch.set_num_threads(2)
    directory()
    seconds = isolated("vlm:lora", ["tfcli", "transformers"], warmup=1, steps=3, repeats=2)
    report(
        f"LLaVA-shaped LoRA SFT step (CLIP ViT-B/32 224px + SmolLM2-135M shape, b{BATCH} x {IMAGE + TEXT}, fp32)",
        "tok",
        BATCH * (IMAGE + TEXT),
        seconds,
        peer="transformers",
        target=1.3,
    )
    planned, measured = memory_plan()
    print(
        f"memory plan of finetune sft --train lora: planned {planned:.0f} MB, measured {measured:.0f} MB, "
        f"{100 * (planned - measured) / measured:+.1f}% (target: within 15%)"
    )


if __name__ == "__main__":
    main()
