"""Phi-3 and Phi-4 <-> transformers' Phi3ForCausalLM, as llama-family switches: q/k/v in one
`qkv_proj` and gate/up in one `gate_up_proj` in its checkpoints (tfcli's fused qkv is the same
matrix; gate and up are its halves), partial rotary where partial_rotary_factor says, LongRoPE
scaling, and a sliding window in every layer where the config names one.
"""

from __future__ import annotations

from ..errors import UserError
from ..models.llama import LlamaConfig
from . import llama, positions
from .convert import Export, Rule

ARCHITECTURE = "Phi3ForCausalLM"
normalize = llama.normalize


def config_from_hf(raw: dict, state=None) -> LlamaConfig:
    partial = raw.get("partial_rotary_factor") or positions.rope_parameters(raw).get("partial_rotary_factor") or 1.0
    return LlamaConfig(
        **llama.common_config(raw),
        sliding_window=raw.get("sliding_window") or 0,
        partial_rotary=float(partial),
    )


def config_to_hf(cfg: LlamaConfig) -> dict:
    llama.refuse_switches(cfg, ARCHITECTURE, ("partial_rotary",))
    if cfg.qkv_bias or cfg.out_bias or cfg.mlp_bias or cfg.qk_norm:
        raise UserError(f"this model's biases or q/k norms are not {ARCHITECTURE}'s")
    out = llama.common_to_hf(cfg, ARCHITECTURE)
    out.update(partial_rotary_factor=cfg.partial_rotary, sliding_window=cfg.sliding_window or None)
    if cfg.rope.original_max:
        out["original_max_position_embeddings"] = cfg.rope.original_max
    return out


def rules(cfg: LlamaConfig) -> list[Rule]:
    return llama.rules(cfg, fused=True)


def export(backbone, recipe) -> Export:
    return llama.export(backbone, recipe, config_to_hf)
