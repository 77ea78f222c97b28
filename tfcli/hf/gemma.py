"""Gemma 2 and Gemma 3 (text) <-> transformers' Gemma2ForCausalLM / Gemma3ForCausalLM, as llama-family
switches: GeGLU with tanh-GELU, the embedding scaled by sqrt(d_model), norms before and after each
branch, RMSNorm scaling by (1 + w) (stored here as the 1 + w tfcli's RMSNorm multiplies by: the table
adds 1 on the way in and takes it off on the way out), the query scale from query_pre_attn_scalar,
sliding and global layers alternating by `layer_types`; Gemma 2 soft-caps the scores and the
logits, Gemma 3 has per-head q/k norms and turns its sliding layers by their own rotary base.
"""

from __future__ import annotations

from ..errors import UserError
from ..models.llama import LlamaConfig
from . import llama, positions, registry
from .convert import Export, Rule
from .traits import Decoder

normalize = llama.normalize


def config_from_hf(raw: dict, state=None) -> LlamaConfig:
    traits = registry.decoder_traits(raw["model_type"])
    if raw.get("use_bidirectional_attention"):
        raise UserError(f"{raw['model_type']}: bidirectional attention (EmbeddingGemma) is not supported")
    local = positions.rope_parameters(raw, "sliding_attention")
    return LlamaConfig(
        **llama.common_config(raw, tie_default=True, activation="gelu_tanh"),
        norms="both",
        qkv_bias=bool(raw.get("attention_bias", False)),
        out_bias=bool(raw.get("attention_bias", False)),
        qk_norm=traits.value("qk_norm"),
        sliding_window=raw.get("sliding_window") or 0,
        layer_types=_layer_types(raw, traits),
        local_rope_theta=float(local.get("rope_theta") or raw.get("rope_local_base_freq") or 10000.0)
        if traits.reads("rope_local_base_freq")
        else 0.0,
        embed_scale=raw["hidden_size"] ** 0.5,
        attn_scale=raw.get("query_pre_attn_scalar", 256) ** -0.5,
        attn_softcap=float(raw.get("attn_logit_softcapping") or 0.0) if traits.reads("attn_logit_softcapping") else 0.0,
        logit_softcap=float(raw.get("final_logit_softcapping") or 0.0),
    )


def _layer_types(raw: dict, traits: Decoder) -> tuple[str, ...]:
    """'sliding' or 'full' per layer: the config's layer_types, or the pattern older configs imply
    (Gemma 2: every other layer slides, from the first; Gemma 3: all but every sliding_window_pattern-th)."""
    n = raw["num_hidden_layers"]
    every = raw.get("sliding_window_pattern", 6) if traits.reads("sliding_window_pattern") else 2
    if not isinstance(every, int) or every < 1:
        raise UserError(f"{raw['model_type']}: config.json's sliding_window_pattern must be >= 1, not {every!r}")
    return positions.layer_kinds(raw, ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(n)])


def config_to_hf(cfg: LlamaConfig) -> dict:
    model_type = cfg.hf_model_type
    traits = registry.decoder_traits(model_type)
    llama.refuse_switches(cfg, registry.architecture(model_type), traits.holds)
    if cfg.norms != "both" or cfg.activation != "gelu_tanh" or cfg.qk_norm != traits.value("qk_norm"):
        raise UserError(f"this model's norms or MLP are not {registry.architecture(model_type)}'s")
    out = llama.common_to_hf(cfg, registry.architecture(model_type))
    del out["hidden_act"]
    layer_types = cfg.layer_types or ("sliding" if cfg.sliding_window else "full",) * cfg.n_layer
    out.update(
        hidden_activation="gelu_pytorch_tanh",
        attention_bias=cfg.qkv_bias,
        query_pre_attn_scalar=_whole(cfg.attn_scale**-2) if cfg.attn_scale else cfg.head_dim,
        sliding_window=cfg.sliding_window or None,
        layer_types=[f"{t}_attention" for t in layer_types],
        final_logit_softcapping=cfg.logit_softcap or None,
        attn_logit_softcapping=cfg.attn_softcap or None,
    )
    if traits.reads("rope_local_base_freq"):  # Gemma 3's sliding layers turn by their own base
        full = {"rope_type": "default", "rope_theta": cfg.rope.theta, **out.pop("rope_scaling", {})}
        local = {"rope_type": "default", "rope_theta": cfg.local_rope_theta or cfg.rope.theta}
        out["rope_parameters"] = {"full_attention": full, "sliding_attention": local}
        del out["rope_theta"]
    return out


def _whole(x: float) -> int | float:
    """transformers' Gemma configs take an int query_pre_attn_scalar (256, 168, ...)."""
    return round(x) if abs(x - round(x)) < 1e-6 else x


def rules(cfg: LlamaConfig) -> list[Rule]:
    return llama.rules(cfg, norm_offset=1.0)


def export(backbone, recipe) -> Export:
    return llama.export(backbone, recipe, config_to_hf)
