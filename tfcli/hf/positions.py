"""transformers' position settings, read (and written) in one place: the rope (`rope_parameters`, or
the older `rope_theta` + `rope_scaling`, per layer type where a model has several), the sliding
window and the per-layer attention kinds (`layer_types`). models/ knows only tfcli's own fields
(models/rotary.py: RopeScaling); the tables read transformers' keys through these functions.
"""

from __future__ import annotations

import math
from dataclasses import replace

from ..errors import UserError
from ..models.rotary import RopeScaling
from .traits import Decoder


def rope_scaling_of(theta: float, params: dict | None) -> RopeScaling:
    """A transformers config's rope settings (`rope_parameters`, or the older `rope_theta` +
    `rope_scaling`) -> RopeScaling. Unknown rope types are refused by check_rope."""
    p = dict(params or {})
    if p.get("mscale") and p.get("mscale_all_dim") and not p.get("attention_factor"):  # DeepSeek's yarn
        factor = float(p.get("factor") or 1.0)
        mscale = lambda m: 0.1 * m * math.log(factor) + 1.0 if factor > 1 else 1.0  # noqa: E731
        p["attention_factor"] = mscale(p["mscale"]) / mscale(p["mscale_all_dim"])
    kind = p.get("rope_type") or p.get("type") or "default"
    return RopeScaling(
        theta=float(p.get("rope_theta") or theta),
        type=kind,
        factor=float(p.get("factor") or 1.0),
        original_max=int(p.get("original_max_position_embeddings") or 0),
        low_freq_factor=float(p.get("low_freq_factor") or 1.0),
        high_freq_factor=float(p.get("high_freq_factor") or 4.0),
        beta_fast=float(p.get("beta_fast") or 32.0),
        beta_slow=float(p.get("beta_slow") or 1.0),
        attention_factor=float(p.get("attention_factor") or 0.0),
        truncate=bool(p.get("truncate", True)),
        short_factor=tuple(float(f) for f in p.get("short_factor") or ()),
        long_factor=tuple(float(f) for f in p.get("long_factor") or ()),
    )


def latent_attention_scale(raw: dict, qk_head_dim: int) -> float:
    """DeepSeek's query scale: 1/sqrt(qk_head_dim), times yarn's mscale(factor, mscale_all_dim) squared
    where a scaled rope names mscale_all_dim (transformers' yarn_apply_mscale)."""
    p = rope_parameters(raw)
    scale = qk_head_dim**-0.5
    factor, all_dim = float(p.get("factor") or 1.0), p.get("mscale_all_dim") or 0
    if (p.get("rope_type") or p.get("type") or "default") != "default" and all_dim and factor > 1:
        scale *= (0.1 * all_dim * math.log(factor) + 1.0) ** 2
    return scale


def latent_rope_to_hf(r: RopeScaling, attn_scale: float, qk_head_dim: int) -> dict:
    """rope_to_hf for DeepSeek's yarn: the query scale's and the cos/sin scale's mscale and
    mscale_all_dim, recovered from them (the inverse of latent_attention_scale and rope_scaling_of)."""
    out = rope_to_hf(r)
    squared = attn_scale * qk_head_dim**0.5  # mscale(factor, mscale_all_dim) ** 2
    if r.type != "yarn" or r.factor <= 1 or abs(squared - 1.0) < 1e-12:
        return out
    log = 0.1 * math.log(r.factor)
    all_dim = squared**0.5
    mscale = (out.pop("attention_factor", 0.0) or 1.0) * all_dim
    return {**out, "mscale": (mscale - 1.0) / log, "mscale_all_dim": (all_dim - 1.0) / log}


def rope_parameters(raw: dict, kind: str = "") -> dict:
    """A config's rope settings: transformers 5's `rope_parameters` (per layer type where the model has
    several: `kind`), or the older `rope_theta` + `rope_scaling`."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if kind and isinstance(params.get(kind), dict):
        params = params[kind]
    return dict(params)


def rope_of(raw: dict) -> RopeScaling:
    """Dynamic NTK scaling grows theta past max_position_embeddings: kept as the rope's own trained
    length, so that raising tfcli's model.max_seq_len (the context) is what lets it grow."""
    params = rope_parameters(raw, "full_attention")
    if "original_max_position_embeddings" not in params and raw.get("original_max_position_embeddings"):
        params["original_max_position_embeddings"] = raw["original_max_position_embeddings"]  # Phi-3
    if params.get("rope_type", params.get("type")) == "longrope" and not params.get("factor"):
        params["factor"] = raw["max_position_embeddings"] / params["original_max_position_embeddings"]
    rope = rope_scaling_of(raw.get("rope_theta") or 10000.0, params)
    return replace(rope, original_max=raw["max_position_embeddings"]) if rope.type == "dynamic" else rope


LAYER_KINDS = {"full_attention": "full", "sliding_attention": "sliding"}  # transformers' names -> tfcli's


def layer_kinds(raw: dict, implied: list[str], n: int | None = None) -> tuple[str, ...]:
    """'full' or 'sliding' per layer: the config's `layer_types` (else `implied`, the pattern older configs
    imply), one per layer; a kind tfcli does not implement (Llama 4's chunked_attention) or a list of
    another length is one line naming the field, where it would silently run as full attention."""
    n = raw["num_hidden_layers"] if n is None else n
    types = raw.get("layer_types") or implied
    where = raw.get("model_type", "this model")
    if not isinstance(types, list) or len(types) != n:
        got = len(types) if isinstance(types, list) else type(types).__name__
        raise UserError(f"{where}: config.json's layer_types has {got} entries for {n} layers")
    unknown = next((t for t in types if t not in LAYER_KINDS), None)
    if unknown is not None:
        raise UserError(
            f"{where}: config.json's layer_types names {unknown!r}, which tfcli does not implement "
            f"({', '.join(LAYER_KINDS)} only)"
        )
    return tuple(LAYER_KINDS[t] for t in types)


def window_of(raw: dict, traits: Decoder) -> int:
    """The sliding window every layer uses (0: none). Mistral slides in every layer; Qwen2/3 only with
    use_sliding_window, from layer max_window_layers on: tfcli's one window per model takes all or none."""
    window = raw.get("sliding_window") or 0
    if traits.reads("sliding_window") or not window:
        return window
    implied = [
        "sliding_attention"
        if raw.get("use_sliding_window") and i >= raw.get("max_window_layers", 0)
        else "full_attention"
        for i in range(raw["num_hidden_layers"])
    ]
    types = layer_kinds(raw, implied)
    if len(set(types)) > 1:
        raise UserError(
            f"{raw['model_type']}: a sliding window in some layers only ({types.count('sliding')} "
            f"of {len(types)}) is not supported"
        )
    return window if types and types[0] == "sliding" else 0


def rope_to_hf(r: RopeScaling) -> dict:
    """RopeScaling -> a config.json's `rope_scaling` (a scaled rope's; the default has none)."""
    out = {"rope_type": r.type, "factor": r.factor}
    if r.original_max and r.type != "dynamic":
        out["original_max_position_embeddings"] = r.original_max
    if r.type == "llama3":
        out.update(low_freq_factor=r.low_freq_factor, high_freq_factor=r.high_freq_factor)
    if r.type == "yarn":
        out.update(beta_fast=r.beta_fast, beta_slow=r.beta_slow, truncate=r.truncate)
    if r.type == "longrope":
        out.update(short_factor=list(r.short_factor), long_factor=list(r.long_factor))
    if r.attention_factor and r.type in ("yarn", "longrope"):
        out["attention_factor"] = r.attention_factor
    return out


def layer_rope_theta(raw: dict, kind: str, old: str, default: float) -> float:
    """The rotary base of one kind of layer ('full', 'sliding'): transformers 5's per-layer-type
    `rope_parameters`, else the older key `old` (ModernBERT's global_rope_theta); a scaled rope there is
    one line."""
    params = (raw.get("rope_parameters") or {}).get(f"{kind}_attention") or {}
    if params.get("rope_type", "default") != "default":
        where = raw.get("model_type", "this model")
        raise UserError(f"{where}: rope_type {params['rope_type']!r} is not supported (supported: default)")
    return float(params.get("rope_theta") or raw.get(old) or default)
