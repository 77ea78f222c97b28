"""OLMo 2 <-> transformers' Olmo2ForCausalLM, as llama-family switches: the norms after attention and
after the MLP instead of before them, and q/k norms over the whole projection (not per head).
"""

from __future__ import annotations

from ..errors import UserError
from ..models.llama import LlamaConfig
from . import llama
from .convert import Export, Rule

ARCHITECTURE = "Olmo2ForCausalLM"
normalize = llama.normalize


def config_from_hf(raw: dict, state=None) -> LlamaConfig:
    bias = bool(raw.get("attention_bias", False))
    return LlamaConfig(
        **llama.common_config(raw),
        norms="post",
        qk_norm=True,
        qk_norm_whole=True,
        qkv_bias=bias,
        out_bias=bias,
    )


def config_to_hf(cfg: LlamaConfig) -> dict:
    llama.refuse_switches(cfg, ARCHITECTURE, ("norms", "qk_norm_whole"))
    if cfg.norms != "post" or not (cfg.qk_norm and cfg.qk_norm_whole) or cfg.qkv_bias != cfg.out_bias:
        raise UserError(f"this model's norms or biases are not {ARCHITECTURE}'s")
    return {**llama.common_to_hf(cfg, ARCHITECTURE), "attention_bias": cfg.qkv_bias}


def rules(cfg: LlamaConfig) -> list[Rule]:
    return llama.rules(cfg)


def export(backbone, recipe) -> Export:
    return llama.export(backbone, recipe, config_to_hf)
