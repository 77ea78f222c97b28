"""Mixtures of experts (issue 60): tfcli's native MoE against transformers' Qwen3MoeForCausalLM (and
peft) on the same random weights, read by both sides from one transformers directory; the same batch,
the same threads, fp32, each contender in a fresh process of its own.

  The model: Qwen3-MoE's shape (d 1024, 8 heads of 128 over 2 key/value heads, per-head q/k norms,
  renormalised top-k) cut to what this machine trains: 6 layers of 8 experts (inner width 768), each
  token routed to 2; the vocabulary cut to 32,000 so that the experts, not the LM head, are most of a
  step's work. Both sides train with the load-balancing loss (transformers' output_router_logits).

  full   a training step of every weight (AdamW, fused), batch BENCH_MOE_BATCH (4) x 256 tokens
  lora   rank 8 on q, k, v, o (the attention: tfcli's default for a mixture; peft's LoraConfig the same)
  decode greedy decoding with the KV cache, batch 1, a 32-token prompt + 64 new tokens, both sides
         checked to produce the same ids before anything is timed

Target: tfcli >= 1.5x transformers' tokens/s in each.

    python -m benchmarks moe
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

from benchmarks.common import WARMUP, Contenders, isolated, report, train_step
from benchmarks.generation import greedy_ids

BATCH, SEQ = int(os.environ.get("BENCH_MOE_BATCH", 4)), 256
PROMPT, NEW = 32, 64
TARGETS = ("q", "k", "v", "o")
SHAPE = dict(
    vocab_size=32000,
    hidden_size=1024,
    intermediate_size=3072,
    moe_intermediate_size=768,
    num_hidden_layers=6,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=128,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    router_aux_loss_coef=0.001,
    max_position_embeddings=4096,
)
# gpt-oss's shape (64-wide heads over grouped key/value heads, sinks, alternating 128-token windows,
# biased experts) cut the same way: the memory benchmark's gpt-oss-lora
GPT_OSS_SHAPE = dict(
    vocab_size=32000,
    hidden_size=1024,
    intermediate_size=768,
    num_hidden_layers=6,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=64,
    num_local_experts=8,
    num_experts_per_tok=2,
    sliding_window=128,
    router_aux_loss_coef=0.001,
    max_position_embeddings=4096,
)
# DeepSeek-V3's shape (latent attention with a query bottleneck, a dense first layer, 16 experts in 4
# groups of which 2 compete, a shared expert) cut the same way: the memory benchmark's deepseek-lora
DEEPSEEK_SHAPE = dict(
    vocab_size=32000,
    hidden_size=1024,
    intermediate_size=2816,
    moe_intermediate_size=512,
    num_hidden_layers=6,
    num_attention_heads=8,
    num_key_value_heads=8,
    kv_lora_rank=256,
    q_lora_rank=384,
    qk_rope_head_dim=32,
    qk_nope_head_dim=64,
    v_head_dim=64,
    n_routed_experts=16,
    num_experts_per_tok=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
    n_group=4,
    topk_group=2,
    max_position_embeddings=4096,
)
DIRECTORY = Path(os.environ.get("BENCH_MOE_DIR", Path(tempfile.gettempdir()) / "tfcli-bench-moe"))


def directory() -> Path:
    """The random Qwen3-MoE-shaped model as a transformers directory (written once, then reused)."""
    import transformers

    if not (DIRECTORY / "config.json").is_file():
        config = transformers.AutoConfig.for_model("qwen3_moe", **SHAPE, pad_token_id=0)
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(DIRECTORY)
    return DIRECTORY


def sft_directory(model_type: str = "qwen3_moe") -> Path:
    """The same shape (or gpt-oss's, DeepSeek-V3's) with GPT-2's tokenizer (its 50,257 tokens) beside
    it: a directory `tfcli finetune` takes (the memory benchmark's moe-*, gpt-oss-lora, deepseek-lora)."""
    import transformers

    from tfcli.data.tokenizers import load_tokenizer_files

    shape = {"gpt_oss": GPT_OSS_SHAPE, "deepseek_v3": DEEPSEEK_SHAPE}.get(model_type, SHAPE)
    path = DIRECTORY.with_name(DIRECTORY.name + ("-sft" if model_type == "qwen3_moe" else f"-{model_type}"))
    if not (path / "tokenizer.json").is_file():
        tok = load_tokenizer_files("builtin:gpt2", ["<|endoftext|>"])
        config = transformers.AutoConfig.for_model(model_type, **{**shape, "vocab_size": tok.vocab_size})
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
        tok.tok.save(str(path / "tokenizer.json"))
    return path


def tokens(n: int, length: int) -> torch.Tensor:
    return torch.randint(0, SHAPE["vocab_size"], (n, length), generator=torch.Generator().manual_seed(0))


def ours():
    from tfcli.engine.backbone import load_hf_weights
    from tfcli.hf.interop import read_pretrained
    from tfcli.models import build_model

    cfg, state = read_pretrained(directory())
    return load_hf_weights(build_model(cfg), state, directory())


def theirs():
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(directory())


def _ours_step(lora: bool):
    from tfcli import adapters
    from tfcli.engine.trainer import ObjectiveModule
    from tfcli.objectives.next_token import loss
    from tfcli.recipe import AdapterConfig

    model = ours().train()
    ids = tokens(BATCH, SEQ + 1)
    b = {"input_ids": ids[:, :-1], "targets": ids[:, 1:]}
    model.requires_grad_(True)
    if lora:
        adapters.apply(model, "lora", AdapterConfig(rank=8, alpha=16, dropout=0.0, targets=TARGETS))
    module = ObjectiveModule(model, torch.nn.ModuleDict(), loss)  # the LM loss + the routers' balancing loss
    params = [p for p in model.parameters() if p.requires_grad]
    return train_step(lambda: module(b)[0], torch.optim.AdamW(params, lr=1e-4, fused=True))


def _their_step(lora: bool):
    model = theirs().train()
    ids = tokens(BATCH, SEQ)
    if lora:
        import peft

        config = peft.LoraConfig(
            r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]
        )
        model = peft.get_peft_model(model, config)
    params = [p for p in model.parameters() if p.requires_grad]
    return train_step(
        lambda: model(input_ids=ids, labels=ids, output_router_logits=True).loss,
        torch.optim.AdamW(params, lr=1e-4, fused=True),
    )


def full() -> Contenders:
    return {"tfcli": lambda: _ours_step(False), "transformers": lambda: _their_step(False)}


def lora() -> Contenders:
    return {"tfcli": lambda: _ours_step(True), "transformers": lambda: _their_step(True)}


def decode() -> Contenders:
    from tfcli.generate import generate_tokens

    prompt = tokens(1, PROMPT)

    def ours_ids():
        model = ours().eval()
        return lambda: list(generate_tokens(model, prompt, max_new_tokens=NEW, temperature=0.0))

    def their_ids():
        model = theirs().eval()
        return lambda: greedy_ids(model, prompt, NEW, PROMPT)[0]

    return {"tfcli": ours_ids, "transformers": their_ids}


def main() -> None:
    torch.set_num_threads(2)
    directory()
    contenders = decode()
    mine, peer = contenders["tfcli"]()(), contenders["transformers"]()()
    if mine != peer:
        raise SystemExit(
            f"moe decode: greedy ids differ at position {next(i for i, (a, b) in enumerate(zip(mine, peer)) if a != b)}"
        )
    for mode in ("full", "lora"):
        seconds = isolated(f"moe:{mode}", ["tfcli", "transformers"], warmup=WARMUP, steps=4, repeats=1)
        report(
            f"qwen3_moe-shaped 8x2 experts {mode} train step (b{BATCH} x {SEQ}, fp32)",
            "tok",
            BATCH * SEQ,
            seconds,
            target=1.5,
        )
    seconds = isolated("moe:decode", ["tfcli", "transformers"], warmup=WARMUP, steps=4, repeats=1)
    report(
        f"qwen3_moe-shaped greedy decoding ({PROMPT} prompt + {NEW} new, batch 1, KV cache, fp32)",
        "tok",
        NEW,
        seconds,
        target=1.5,
    )


if __name__ == "__main__":
    main()
