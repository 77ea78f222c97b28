"""Llama, Qwen2, Mistral and Qwen3 <-> transformers' *ForCausalLM: the weight table and config map.

transformers' separate q/k/v projections become tfcli's fused qkv of unequal widths (grouped-query
attention); its rotary layout (halves rotated, `rotate_half`) is tfcli's, so no rows are permuted.
The four architectures differ only in the switches of LlamaConfig: qkv / output biases (Qwen2,
Llama's attention_bias), per-head q/k norms (Qwen3), a sliding window (Mistral).
"""

from __future__ import annotations

from dataclasses import replace

from ..data.special_tokens import config_text
from ..errors import UserError
from ..models.llama import LlamaConfig
from ..models.rotary import RopeScaling, rope_scaling_of
from .convert import Export, Rule, refuse_classifier, rule

MODEL_TYPES = ("llama", "qwen2", "mistral", "qwen3")
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
_LAYER = [
    ("norm_attn", "input_layernorm"),
    ("norm_mlp", "post_attention_layernorm"),
    ("mlp.gate", "mlp.gate_proj"),
    ("mlp.up", "mlp.up_proj"),
    ("mlp.down", "mlp.down_proj"),
    ("attn.out", "self_attn.o_proj"),
]


def config_from_hf(raw: dict, state=None) -> LlamaConfig:
    model_type = raw["model_type"]
    if raw.get("hidden_act", "silu") != "silu":
        raise UserError(f"unsupported {model_type} activation {raw['hidden_act']!r} (tfcli's llama family is SwiGLU)")
    n_head = raw["num_attention_heads"]
    both = bool(raw.get("attention_bias", False))  # Llama, Qwen3: on q, k, v and o alike
    return LlamaConfig(
        n_layer=raw["num_hidden_layers"],
        n_head=n_head,
        n_kv_head=raw.get("num_key_value_heads") or n_head,
        d_model=raw["hidden_size"],
        head_dim=raw.get("head_dim") or raw["hidden_size"] // n_head,
        d_ff=raw["intermediate_size"],
        max_seq_len=raw["max_position_embeddings"],
        vocab_size=raw["vocab_size"],
        dropout=raw.get("attention_dropout", 0.0),
        layer_norm_eps=raw.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2" or both,
        out_bias=both,
        mlp_bias=bool(raw.get("mlp_bias", False)),
        qk_norm=model_type == "qwen3",
        sliding_window=_window(raw),
        rope=_rope(raw),
        hf_model_type=model_type,
    )


def _rope(raw: dict) -> RopeScaling:
    """Dynamic NTK scaling grows theta past max_position_embeddings: kept as the rope's own trained
    length, so that raising tfcli's model.max_seq_len (the context) is what lets it grow."""
    rope = rope_scaling_of(raw.get("rope_theta") or 10000.0, raw.get("rope_parameters") or raw.get("rope_scaling"))
    return replace(rope, original_max=raw["max_position_embeddings"]) if rope.type == "dynamic" else rope


def _window(raw: dict) -> int:
    """The sliding window every layer uses (0: none). Mistral slides in every layer; Qwen2/3 only with
    use_sliding_window, from layer max_window_layers on: tfcli's one window per model takes all or none."""
    window = raw.get("sliding_window") or 0
    if raw["model_type"] == "mistral" or not window:
        return window
    types = raw.get("layer_types") or [
        "sliding_attention"
        if raw.get("use_sliding_window") and i >= raw.get("max_window_layers", 0)
        else "full_attention"
        for i in range(raw["num_hidden_layers"])
    ]
    if len(set(types)) > 1:
        raise UserError(
            f"{raw['model_type']}: a sliding window in some layers only ({types.count('sliding_attention')} "
            f"of {len(types)}) is not supported"
        )
    return window if types and types[0] == "sliding_attention" else 0


def _cannot_express(cfg: LlamaConfig, model_type: str) -> str:
    """Why `model_type` cannot hold this model exactly ("" if it can)."""
    if cfg.qk_norm != (model_type == "qwen3"):
        return "q/k norms" if cfg.qk_norm else "no q/k norms"
    if model_type == "qwen2":
        return "" if cfg.qkv_bias and not cfg.out_bias and not cfg.mlp_bias else "its biases"
    if cfg.qkv_bias != cfg.out_bias or (cfg.mlp_bias and model_type != "llama"):
        return "its biases"
    if cfg.sliding_window and model_type != "mistral":
        return "a sliding window"
    return ""


def config_to_hf(cfg: LlamaConfig) -> dict:
    model_type = cfg.hf_model_type
    reason = _cannot_express(cfg, model_type)
    if reason:
        raise UserError(
            f"this llama-family model has {reason}, which transformers' {ARCHITECTURES[model_type]} "
            f"cannot hold; set model.hf_model_type to one that can (llama, qwen2, mistral, qwen3)"
        )
    out = {
        "architectures": [ARCHITECTURES[model_type]],
        "model_type": model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff,
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.n_kv_head,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": _trained_length(cfg),
        "rms_norm_eps": cfg.layer_norm_eps,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_dropout": cfg.dropout,
        "rope_theta": cfg.rope.theta,
        "initializer_range": 0.02,
    }
    if cfg.rope.type != "default":
        out["rope_scaling"] = _rope_to_hf(cfg.rope)
    if model_type in ("llama", "qwen3"):
        out["attention_bias"] = cfg.out_bias
    if model_type == "llama":
        out["mlp_bias"] = cfg.mlp_bias
    if model_type == "mistral":
        out["sliding_window"] = cfg.sliding_window or None
    if model_type in ("qwen2", "qwen3"):
        out.update(use_sliding_window=False, sliding_window=None)
    return out


def _trained_length(cfg: LlamaConfig) -> int:
    """transformers' dynamic rope grows past max_position_embeddings, which must stay the trained length."""
    return cfg.rope.original_max if cfg.rope.type == "dynamic" and cfg.rope.original_max else cfg.max_seq_len


def _rope_to_hf(r: RopeScaling) -> dict:
    out = {"rope_type": r.type, "factor": r.factor}
    if r.original_max and r.type != "dynamic":
        out["original_max_position_embeddings"] = r.original_max
    if r.type == "llama3":
        out.update(low_freq_factor=r.low_freq_factor, high_freq_factor=r.high_freq_factor)
    if r.type == "yarn":
        out.update(beta_fast=r.beta_fast, beta_slow=r.beta_slow, truncate=r.truncate)
        if r.attention_factor:
            out["attention_factor"] = r.attention_factor
    return out


def rules(cfg: LlamaConfig) -> list[Rule]:
    out = [rule("model.wte.weight", "model.embed_tokens.weight"), rule("model.ln_f.weight", "model.norm.weight")]
    if not cfg.tie_word_embeddings:
        out.append(rule("model.lm_head.weight", "lm_head.weight"))
    widths = (cfg.n_head * cfg.head_dim, cfg.n_kv_head * cfg.head_dim, cfg.n_kv_head * cfg.head_dim)
    for i in range(cfg.n_layer):
        ours, theirs = f"model.blocks.{i}", f"model.layers.{i}"
        qkv = [f"{theirs}.self_attn.{p}_proj" for p in "qkv"]
        out.append(rule(f"{ours}.attn.qkv.weight", *(f"{n}.weight" for n in qkv), widths=widths))
        if cfg.qkv_bias:
            out.append(rule(f"{ours}.attn.qkv.bias", *(f"{n}.bias" for n in qkv), widths=widths))
        out += [rule(f"{ours}.{a}.weight", f"{theirs}.{b}.weight") for a, b in _LAYER]
        out += [rule(f"{ours}.attn.out.bias", f"{theirs}.self_attn.o_proj.bias")] if cfg.out_bias else []
        out += [
            rule(f"{ours}.mlp.{p}.bias", f"{theirs}.mlp.{p}_proj.bias") for p in ("gate", "up", "down") if cfg.mlp_bias
        ]
        out += [
            rule(f"{ours}.attn.{n}.weight", f"{theirs}.self_attn.{n}.weight")
            for n in ("q_norm", "k_norm")
            if cfg.qk_norm
        ]
    return out


def normalize(state: dict) -> dict:
    """A bare LlamaModel's keys ('layers.0...', 'norm.weight') get the causal LM's 'model.' prefix."""
    return {k if k.startswith(("model.", "lm_head.")) else f"model.{k}": v for k, v in state.items()}


def export(backbone, recipe) -> Export:
    """*ForCausalLM of the architecture the model came from (a pretrained, text-to-text or SFT run)."""
    if "classifier.weight" in backbone.heads:
        refuse_classifier(
            "llama",
            getattr(recipe.settings if recipe is not None else None, "pooling", "last"),
            "transformers' LlamaForSequenceClassification scores without a bias, which tfcli's "
            "classifier has; finetune with --head text to export a causal LM",
        )
    config, tok = config_to_hf(backbone.cfg), backbone.tokenizer
    files = {}
    if tok is not None:
        ids = {
            f"{name}_token_id": tok.token_id(text)
            for name, text in (("bos", tok.specials.bos), ("eos", tok.specials.eos), ("pad", tok.specials.pad))
            if text
        }
        config.update({k: v for k, v in ids.items() if v is not None})
        config.setdefault("eos_token_id", tok.eos_id)
        files["tokenizer_config.json"] = config_text(
            tok.specials,
            tok.chat_template,
            {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": backbone.cfg.max_seq_len},
        )
    return Export(config, files=files)
