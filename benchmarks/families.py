"""The llama family's newer architectures (issue 59) against transformers (and peft) at real shapes,
random weights: the same weights read by both sides from one transformers directory, the same batch,
the same threads, fp32, each contender in a fresh process of its own.

  gemma3    Gemma-3-270M's shape (18 layers, d 640, 4 heads of 256, 1 key/value head, GeGLU 2048,
            sliding window 512 in five of six layers, vocabulary 262,144)
  phi3      Phi-3-mini's shape (d 3072, 32 heads of 96, partial rotary off, MLP 8192, vocabulary
            32,064) cut to 2 layers, so that a full step (weights, gradients, AdamW) fits this machine

  stablelm  a StableLM shape (d 1024, 4 layers, vocabulary 50,304) with no native family: the generic
            path (transformers' own modules inside tfcli; target: within 10% of transformers itself)

  modernbert  ModernBERT-base's shape (22 layers, d 768, local windows of 128 in two of three layers):
            an MNLI classification step (batch 16 x 128, 3 labels, every weight), against
            ModernBertForSequenceClassification (its head read into tfcli's [CLS] pooler and classifier)

Each decoder: a full training step (AdamW, fused) and a LoRA step (rank 8 on q, k, v, o, gate, up, down;
peft's LoraConfig the same; Phi-3's fused qkv_proj and gate_up_proj adapted whole on peft's side,
which is the same number of adapted outputs), batch BENCH_FAMILIES_BATCH (2) x 256 tokens.
Target: tfcli >= 1.3x transformers' tokens/s.

    python -m benchmarks families
    BENCH_FAMILIES=phi3 python -m benchmarks families
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

from benchmarks.common import WARMUP, Contenders, isolated, report, train_step

BATCH, SEQ = int(os.environ.get("BENCH_FAMILIES_BATCH", 2)), 256
TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
HF_TARGETS = {
    "gemma3": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "stablelm": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
}
SHAPES = {
    "gemma3": dict(
        model_type="gemma3_text",
        vocab_size=262144,
        hidden_size=640,
        intermediate_size=2048,
        num_hidden_layers=18,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        query_pre_attn_scalar=256,
        sliding_window=512,
        max_position_embeddings=32768,
    ),
    "phi3": dict(
        model_type="phi3",
        vocab_size=32064,
        hidden_size=3072,
        intermediate_size=8192,
        num_hidden_layers=2,
        num_attention_heads=32,
        num_key_value_heads=32,
        max_position_embeddings=4096,
    ),
    "modernbert": dict(
        model_type="modernbert",
        vocab_size=50368,
        hidden_size=768,
        intermediate_size=1152,
        num_hidden_layers=22,
        num_attention_heads=12,
        max_position_embeddings=8192,
        num_labels=3,
    ),
    "stablelm": dict(
        model_type="stablelm",
        vocab_size=50304,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=4,
        num_attention_heads=16,
        num_key_value_heads=16,
        max_position_embeddings=4096,
    ),
}
DIRECTORY = Path(os.environ.get("BENCH_FAMILIES_DIR", Path(tempfile.gettempdir()) / "tfcli-bench-families"))


def directory(name: str) -> Path:
    """The random model of `name` as a transformers directory (written once, then reused)."""
    import transformers

    path = DIRECTORY / name
    if not (path / "config.json").is_file():
        shape = dict(SHAPES[name])
        config = transformers.AutoConfig.for_model(shape.pop("model_type"), **shape, pad_token_id=0)
        torch.manual_seed(0)
        auto = (
            transformers.AutoModelForSequenceClassification
            if name == "modernbert"
            else transformers.AutoModelForCausalLM
        )
        auto.from_config(config).save_pretrained(path)
    return path


def batch(vocab: int) -> dict[str, torch.Tensor]:
    block = torch.randint(0, vocab, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
    return {"input_ids": block[:, :-1], "targets": block[:, 1:]}


def _ours_step(name: str, lora: bool):
    from tfcli import adapters
    from tfcli.engine.backbone import load_hf_weights
    from tfcli.hf.interop import read_pretrained
    from tfcli.models import build_model
    from tfcli.objectives.next_token import loss
    from tfcli.recipe import AdapterConfig

    cfg, state = read_pretrained(directory(name))  # a directory without a tokenizer: the model alone
    model = load_hf_weights(build_model(cfg), state, directory(name)).train()
    b = batch(model.cfg.vocab_size)
    model.requires_grad_(True)
    if lora:
        adapters.apply(model, "lora", AdapterConfig(rank=8, alpha=16, dropout=0.0, targets=TARGETS))
    params = [p for p in model.parameters() if p.requires_grad]
    return train_step(lambda: loss(model, None, b)[0], torch.optim.AdamW(params, lr=1e-4, fused=True))


def _their_step(name: str, lora: bool):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(directory(name)).train()
    b = batch(model.config.vocab_size)
    if lora:
        import peft

        model = peft.get_peft_model(
            model, peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=HF_TARGETS[name])
        )
    params = [p for p in model.parameters() if p.requires_grad]
    return train_step(
        lambda: model(input_ids=b["input_ids"], labels=b["input_ids"]).loss,
        torch.optim.AdamW(params, lr=1e-4, fused=True),
    )


def contenders(name: str, lora: bool) -> Contenders:
    return {"tfcli": lambda: _ours_step(name, lora), "transformers": lambda: _their_step(name, lora)}


def gemma3_full() -> Contenders:
    return contenders("gemma3", False)


def gemma3_lora() -> Contenders:
    return contenders("gemma3", True)


def phi3_full() -> Contenders:
    return contenders("phi3", False)


def phi3_lora() -> Contenders:
    return contenders("phi3", True)


MNLI_BATCH, MNLI_SEQ = 16, 128  # ModernBERT: an MNLI classification step (3 labels, [CLS] head), all weights


def _classifier_step(ours: bool):
    import transformers

    labels = torch.randint(0, 3, (MNLI_BATCH,), generator=torch.Generator().manual_seed(1))
    ids = torch.randint(5, 50000, (MNLI_BATCH, MNLI_SEQ), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    if not ours:
        model = transformers.AutoModelForSequenceClassification.from_pretrained(directory("modernbert")).train()
        loss = lambda: model(input_ids=ids, attention_mask=mask, labels=labels).loss  # noqa: E731
        return train_step(loss, torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True))
    from tfcli.engine.backbone import load_hf_weights
    from tfcli.hf.interop import read_pretrained
    from tfcli.models import build_model

    cfg, state = read_pretrained(directory("modernbert"))
    model = load_hf_weights(build_model(cfg), state, directory("modernbert")).train()
    head = torch.nn.Linear(cfg.d_model, 3)
    head.load_state_dict({k[len("heads.classifier.") :]: v for k, v in state.items() if k.startswith("heads.")})
    loss = lambda: torch.nn.functional.cross_entropy(head(model.pool(model(ids, None, mask))), labels)  # noqa: E731
    return train_step(loss, torch.optim.AdamW([*model.parameters(), *head.parameters()], lr=1e-5, fused=True))


def modernbert_mnli() -> Contenders:
    return {"tfcli": lambda: _classifier_step(True), "transformers": lambda: _classifier_step(False)}


def stablelm_full() -> Contenders:
    return contenders("stablelm", False)


def stablelm_lora() -> Contenders:
    return contenders("stablelm", True)


def main() -> None:
    torch.set_num_threads(2)
    for name in os.environ.get("BENCH_FAMILIES", "gemma3,phi3,stablelm,modernbert").split(","):
        directory(name)
        if name == "modernbert":
            seconds = isolated("families:modernbert_mnli", ["tfcli", "transformers"], warmup=WARMUP, steps=4, repeats=1)
            what = f"modernbert-base MNLI step (b{MNLI_BATCH} x {MNLI_SEQ}, fp32)"
            report(what, "example", MNLI_BATCH, seconds, target=1.3)
            continue
        generic = name == "stablelm"  # no native family: the generic path, transformers' own modules
        for mode in ("full", "lora"):
            seconds = isolated(f"families:{name}_{mode}", ["tfcli", "transformers"], warmup=WARMUP, steps=4, repeats=1)
            what = f"{name}{' (generic path)' if generic else ''} {mode} train step (b{BATCH} x {SEQ}, fp32)"
            report(what, "tok", BATCH * SEQ, seconds, target=0.9 if generic else 1.3)


if __name__ == "__main__":
    main()
