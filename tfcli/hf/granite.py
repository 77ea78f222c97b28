"""Granite (3.x) <-> transformers' GraniteForCausalLM, as llama-family switches: the multipliers of the
embedding, of each residual branch and of the attention scores, and the logits divided by
logits_scaling.
"""

from __future__ import annotations

from ..errors import UserError
from ..models.llama import LlamaConfig
from . import llama
from .convert import Export, Rule

ARCHITECTURE = "GraniteForCausalLM"
normalize = llama.normalize


def config_from_hf(raw: dict, state=None) -> LlamaConfig:
    bias = bool(raw.get("attention_bias", False))
    return LlamaConfig(
        **llama.common_config(raw),
        qkv_bias=bias,
        out_bias=bias,
        embed_scale=float(raw.get("embedding_multiplier", 1.0)),
        residual_scale=float(raw.get("residual_multiplier", 1.0)),
        attn_scale=float(raw.get("attention_multiplier", 1.0)),
        logit_scale=1.0 / float(raw.get("logits_scaling", 1.0)),
    )


def config_to_hf(cfg: LlamaConfig) -> dict:
    llama.refuse_switches(cfg, ARCHITECTURE, ("embed_scale", "residual_scale", "attn_scale", "logit_scale"))
    if cfg.qkv_bias != cfg.out_bias or cfg.qk_norm:
        raise UserError(f"this model's biases or q/k norms are not {ARCHITECTURE}'s")
    return {
        **llama.common_to_hf(cfg, ARCHITECTURE),
        "attention_bias": cfg.qkv_bias,
        "mlp_bias": cfg.mlp_bias,
        "embedding_multiplier": cfg.embed_scale,
        "residual_multiplier": cfg.residual_scale,
        "attention_multiplier": cfg.attn_scale or cfg.head_dim**-0.5,
        "logits_scaling": 1.0 / cfg.logit_scale,
    }


def rules(cfg: LlamaConfig) -> list[Rule]:
    return llama.rules(cfg)


def export(backbone, recipe) -> Export:
    return llama.export(backbone, recipe, config_to_hf)
