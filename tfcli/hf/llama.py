"""Llama, Qwen2, Mistral and Qwen3 <-> transformers' *ForCausalLM: the weight table and config map,
and the parts the other llama-family tables (gemma.py, olmo2.py, phi3.py, granite.py, smollm3.py)
build theirs from.

transformers' separate q/k/v projections become tfcli's fused qkv of unequal widths (grouped-query
attention); its rotary layout (halves rotated, `rotate_half`) is tfcli's, so no rows are permuted.
The four architectures differ only in the switches of LlamaConfig: qkv / output biases (Qwen2,
Llama's attention_bias), per-head q/k norms (Qwen3), a sliding window (Mistral).
"""

from __future__ import annotations

from dataclasses import fields, replace

from ..data.special_tokens import config_text
from ..errors import UserError
from ..models.llama import LlamaConfig
from ..models.rotary import RopeScaling, rope_scaling_of
from .convert import Export, Rule, refuse_classifier, rule


def common_config(raw: dict, tie_default: bool = False, activation: str = "silu") -> dict:
    """The LlamaConfig fields every llama-family config.json names the same way."""
    act = raw.get("hidden_activation") or raw.get("hidden_act") or activation
    if ACTIVATIONS.get(act) != activation:
        raise UserError(f"unsupported {raw['model_type']} activation {act!r} (tfcli reads {activation} here)")
    n_head = raw["num_attention_heads"]
    return dict(
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
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", tie_default)),
        mlp_bias=bool(raw.get("mlp_bias", False)),
        rope=_rope(raw),
        hf_model_type=raw["model_type"],
        activation=activation,
    )


ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}  # transformers' -> tfcli's


def config_from_hf(raw: dict, state=None) -> LlamaConfig:
    model_type = raw["model_type"]
    both = bool(raw.get("attention_bias", False))  # Llama, Qwen3: on q, k, v and o alike
    return LlamaConfig(
        **common_config(raw),
        qkv_bias=model_type == "qwen2" or both,
        out_bias=both,
        qk_norm=model_type == "qwen3",
        sliding_window=_window(raw),
    )


def rope_parameters(raw: dict, kind: str = "") -> dict:
    """A config's rope settings: transformers 5's `rope_parameters` (per layer type where the model has
    several: `kind`), or the older `rope_theta` + `rope_scaling`."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if kind and isinstance(params.get(kind), dict):
        params = params[kind]
    return dict(params)


def _rope(raw: dict) -> RopeScaling:
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


def _window(raw: dict) -> int:
    """The sliding window every layer uses (0: none). Mistral slides in every layer; Qwen2/3 only with
    use_sliding_window, from layer max_window_layers on: tfcli's one window per model takes all or none."""
    window = raw.get("sliding_window") or 0
    if raw["model_type"] == "mistral" or not window:
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


# the switches beyond Llama's, Qwen's and Mistral's, and who holds them
SWITCHES = (
    "activation",
    "norms",
    "qk_norm_whole",
    "layer_types",
    "local_rope_theta",
    "nope_layers",
    "partial_rotary",
    "embed_scale",
    "residual_scale",
    "attn_scale",
    "logit_scale",
    "attn_softcap",
    "logit_softcap",
    "n_experts",
)


def refuse_switches(cfg: LlamaConfig, architecture: str, held: tuple[str, ...] = ()) -> None:
    """One line when the model sets a switch `architecture` cannot hold (only those in `held` may differ
    from Llama's)."""
    default = {f.name: f.default for f in fields(LlamaConfig) if f.name in SWITCHES}
    set_here = [name for name in SWITCHES if name not in held and getattr(cfg, name) != default[name]]
    if set_here:
        raise UserError(
            f"this llama-family model sets model.{set_here[0]}, which transformers' {architecture} cannot "
            f"hold; set model.hf_model_type to the architecture it came from"
        )


def architecture(model_type: str) -> str:
    """The transformers class a native model_type's export writes (its record's, hf/registry.py)."""
    from . import registry

    return registry.architecture(model_type)


def config_to_hf(cfg: LlamaConfig) -> dict:
    model_type = cfg.hf_model_type
    reason = _cannot_express(cfg, model_type)
    if reason:
        raise UserError(
            f"this llama-family model has {reason}, which transformers' {architecture(model_type)} "
            f"cannot hold; set model.hf_model_type to one that can (llama, qwen2, mistral, qwen3)"
        )
    refuse_switches(cfg, architecture(model_type))
    out = common_to_hf(cfg, architecture(model_type))
    if model_type in ("llama", "qwen3"):
        out["attention_bias"] = cfg.out_bias
    if model_type == "llama":
        out["mlp_bias"] = cfg.mlp_bias
    if model_type == "mistral":
        out["sliding_window"] = cfg.sliding_window or None
    if model_type in ("qwen2", "qwen3"):
        out.update(use_sliding_window=False, sliding_window=None)
    return out


def common_to_hf(cfg: LlamaConfig, architecture: str) -> dict:
    """The config.json entries every llama-family architecture names the same way."""
    out = {
        "architectures": [architecture],
        "model_type": cfg.hf_model_type,
        "bos_token_id": None,  # the tokenizer's, if the run has one (export); never the architecture's defaults
        "eos_token_id": None,
        "pad_token_id": None,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff,
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.n_kv_head,
        "head_dim": cfg.head_dim,
        "hidden_act": next(k for k, v in ACTIVATIONS.items() if v == cfg.activation),
        "max_position_embeddings": _trained_length(cfg),
        "rms_norm_eps": cfg.layer_norm_eps,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_dropout": cfg.dropout,
        "rope_theta": cfg.rope.theta,
        "initializer_range": 0.02,
    }
    if cfg.rope.type != "default":
        out["rope_scaling"] = _rope_to_hf(cfg.rope)
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
    if r.type == "longrope":
        out.update(short_factor=list(r.short_factor), long_factor=list(r.long_factor))
    if r.attention_factor and r.type in ("yarn", "longrope"):
        out["attention_factor"] = r.attention_factor
    return out


# each block's norms, by where they are (LlamaConfig.norms): tfcli's name -> transformers'
NORMS = {
    "pre": (("norm_attn", "input_layernorm"), ("norm_mlp", "post_attention_layernorm")),
    "post": (("post_attn", "post_attention_layernorm"), ("post_mlp", "post_feedforward_layernorm")),
    "both": (
        ("norm_attn", "input_layernorm"),
        ("post_attn", "post_attention_layernorm"),
        ("norm_mlp", "pre_feedforward_layernorm"),
        ("post_mlp", "post_feedforward_layernorm"),
    ),
}


def rules(cfg: LlamaConfig, norm_offset: float = 0.0, fused: bool = False, experts=None) -> list[Rule]:
    """The weight table. norm_offset: what transformers' norm weights lack of tfcli's (Gemma's 1 + w);
    fused: q/k/v and gate/up in one transformers projection each (Phi-3); experts: how the architecture
    names a mixture of experts' parts (hf/moe.py's ExpertNames) where the config has them."""
    norm = lambda ours, theirs: rule(ours, theirs, offset=norm_offset)  # noqa: E731
    out = [rule("model.wte.weight", "model.embed_tokens.weight"), norm("model.ln_f.weight", "model.norm.weight")]
    if not cfg.tie_word_embeddings:
        out.append(rule("model.lm_head.weight", "lm_head.weight"))
    widths = (cfg.n_head * cfg.head_dim, cfg.n_kv_head * cfg.head_dim, cfg.n_kv_head * cfg.head_dim)
    for i in range(cfg.n_layer):
        ours, theirs = f"model.blocks.{i}", f"model.layers.{i}"
        qkv = [f"{theirs}.self_attn.qkv_proj"] if fused else [f"{theirs}.self_attn.{p}_proj" for p in "qkv"]
        split = () if fused else widths
        out.append(rule(f"{ours}.attn.qkv.weight", *(f"{n}.weight" for n in qkv), widths=split))
        if cfg.qkv_bias:
            out.append(rule(f"{ours}.attn.qkv.bias", *(f"{n}.bias" for n in qkv), widths=split))
        out += [norm(f"{ours}.{a}.weight", f"{theirs}.{b}.weight") for a, b in NORMS[cfg.norms]]
        out.append(rule(f"{ours}.attn.out.weight", f"{theirs}.self_attn.o_proj.weight"))
        out += [rule(f"{ours}.attn.out.bias", f"{theirs}.self_attn.o_proj.bias")] if cfg.out_bias else []
        if cfg.has_experts(i):
            out += experts.rules(cfg, f"{ours}.mlp", theirs)
        else:
            out += mlp_rules(f"{ours}.mlp", f"{theirs}.mlp", fused, cfg.mlp_bias)
        out += [
            norm(f"{ours}.attn.{n}.weight", f"{theirs}.self_attn.{n}.weight")
            for n in ("q_norm", "k_norm")
            if cfg.qk_norm
        ]
    return out


def mlp_rules(ours: str, theirs: str, fused: bool = False, bias: bool = False) -> list[Rule]:
    """A gated MLP's table: tfcli's gate / up / down, transformers' *_proj (gate_up_proj where fused)."""
    if fused:
        out = [
            rule(f"{ours}.{p}.weight", f"{theirs}.gate_up_proj.weight", part=(j, 2))
            for j, p in enumerate(("gate", "up"))
        ]
    else:
        out = [rule(f"{ours}.{p}.weight", f"{theirs}.{p}_proj.weight") for p in ("gate", "up")]
    out.append(rule(f"{ours}.down.weight", f"{theirs}.down_proj.weight"))
    return out + [rule(f"{ours}.{p}.bias", f"{theirs}.{p}_proj.bias") for p in ("gate", "up", "down") if bias]


def normalize(state: dict) -> dict:
    """A bare LlamaModel's keys ('layers.0...', 'norm.weight') get the causal LM's 'model.' prefix."""
    return {k if k.startswith(("model.", "lm_head.")) else f"model.{k}": v for k, v in state.items()}


def export(backbone, recipe, to_hf=config_to_hf) -> Export:
    """*ForCausalLM of the architecture the model came from (a pretrained, text-to-text or SFT run);
    `to_hf`: that architecture's config map."""
    if "classifier.weight" in backbone.heads:
        refuse_classifier(
            "llama",
            getattr(recipe.settings if recipe is not None else None, "pooling", "last"),
            "transformers' LlamaForSequenceClassification scores without a bias, which tfcli's "
            "classifier has; finetune with --head text to export a causal LM",
        )
    config, tok = to_hf(backbone.cfg), backbone.tokenizer
    files = {}
    if tok is not None:
        ids = {
            f"{name}_token_id": tok.token_id(text)
            for name, text in (("bos", tok.specials.bos), ("eos", tok.specials.eos), ("pad", tok.specials.pad))
            if text
        }
        config.update({k: v for k, v in ids.items() if v is not None})
        if config["eos_token_id"] is None:
            config["eos_token_id"] = tok.eos_id
        files["tokenizer_config.json"] = config_text(
            tok.specials,
            tok.chat_template,
            {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": backbone.cfg.max_seq_len},
        )
    return Export(config, files=files)
