"""GPT next-token prediction: cross-entropy of token t+1 given tokens <= t over packed blocks."""
from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ..data import packing
from ..data.packing import BlockSampler
from . import Prepared
from .losses import linear_cross_entropy

FAMILY = "gpt"
DEFAULT_RECIPE = "gpt-mini"
SPECIAL_TOKENS = ["<|endoftext|>"]


def loss(model: nn.Module, heads: nn.ModuleDict, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
    """Mean next-token cross-entropy; `targets` are the inputs shifted left by one."""
    hidden = model(batch["input_ids"])  # (B, T, D)
    value, _ = linear_cross_entropy(hidden, model.lm_head_weight, batch["targets"])
    return value, {"loss": value.detach()}


def eval_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """Add perplexity to averaged held-out metrics."""
    return {**metrics, "ppl": math.exp(min(metrics["loss"], 50.0))}


def flops_per_token(model, seq_len: int) -> float:
    """6 N (forward 2 + backward 4 per parameter) plus attention's 12 L T D (PaLM appendix B)."""
    cfg = model.cfg
    n = sum(p.numel() for p in model.parameters()) - model.wpe.weight.numel()
    return 6.0 * n + 12.0 * cfg.n_layer * seq_len * cfg.d_model


def prepare(recipe, tokenizer, docs, model, rank: int = 0, world_size: int = 1) -> Prepared:
    """Tokenize (cached), hold out the tail of the stream, sample shuffled blocks."""
    data, train = recipe.data, recipe.train
    stream = packing.token_stream(packing.tokenize(docs["train"], tokenizer))
    if docs.get("val") is not None:
        train_tokens = stream
        val_tokens = packing.token_stream(packing.tokenize(docs["val"], tokenizer))
    else:
        train_tokens, val_tokens = packing.split_stream(stream, data.val_fraction, data.seq_len)
    sampler = BlockSampler(train_tokens, data.seq_len, train.batch_size, train.seed, rank, world_size,
                           windows=data.sampling == "windows")

    def val():
        if len(val_tokens) < data.seq_len + 1:
            return iter(())
        return packing.sequential_blocks(val_tokens, data.seq_len, train.batch_size, train.eval_batches,
                                         rank, world_size)

    return Prepared(
        train=sampler,
        val=val,
        loss=loss,
        items_per_batch=lambda b: b["input_ids"].numel(),
        flops_per_item=flops_per_token(model, data.seq_len),
        eval_metrics=eval_metrics,
    )
