"""Llama, Qwen2, Mistral and Qwen3 <-> transformers' *ForCausalLM: the weight table and config map,
and the parts the other llama-family tables (gemma.py, olmo2.py, phi3.py, granite.py, smollm3.py)
build theirs from.

transformers' separate q/k/v projections become tfcli's fused qkv of unequal widths (grouped-query
attention); its rotary layout (halves rotated, `rotate_half`) is tfcli's, so no rows are permuted.
The four architectures differ only in the switches of LlamaConfig: qkv / output biases (Qwen2,
Llama's attention_bias), per-head q/k norms (Qwen3), a sliding window (Mistral).
"""

from __future__ import annotations

from dataclasses import fields

from ..data.special_tokens import config_text
from ..errors import UserError
from ..models.llama import LlamaConfig
from . import positions, registry
from .convert import Export, Rule, refuse_classifier, rule
from .traits import Decoder


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
        rope=positions.rope_of(raw),
        hf_model_type=raw["model_type"],
        activation=activation,
    )


ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}  # transformers' -> tfcli's


def config_from_hf(raw: dict, state=None) -> LlamaConfig:
    traits = registry.decoder_traits(raw["model_type"])
    both = traits.reads("attention_bias") and bool(raw.get("attention_bias", False))  # on q, k, v and o alike
    switches = {"qkv_bias": both, "out_bias": both, "qk_norm": False, **dict(traits.fixed)}
    return LlamaConfig(**common_config(raw), **switches, sliding_window=positions.window_of(raw, traits))


def _cannot_express(cfg: LlamaConfig, traits: Decoder) -> str:
    """Why the architecture of `traits` cannot hold this model exactly ("" if it can)."""
    if cfg.qk_norm != traits.value("qk_norm"):
        return "q/k norms" if cfg.qk_norm else "no q/k norms"
    if traits.value("qkv_bias"):  # q/k/v biases always, none on the output (Qwen2)
        return "" if cfg.qkv_bias and not cfg.out_bias and not cfg.mlp_bias else "its biases"
    if cfg.qkv_bias != cfg.out_bias or (cfg.qkv_bias and not traits.reads("attention_bias")):
        return "its biases"
    if cfg.mlp_bias and not traits.reads("mlp_bias"):
        return "its biases"
    if cfg.sliding_window and not traits.reads("sliding_window"):
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
    "attn_sinks",
    "expert_bias",
    "swiglu_limit",
    "kv_lora_rank",
    "router_score",
    "routed_scale",
    "shared_expert_gate",
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


def config_to_hf(cfg: LlamaConfig) -> dict:
    model_type = cfg.hf_model_type
    traits = registry.decoder_traits(model_type)
    reason = _cannot_express(cfg, traits)
    if reason:
        raise UserError(
            f"this llama-family model has {reason}, which transformers' {registry.architecture(model_type)} "
            f"cannot hold; set model.hf_model_type to one that can ({', '.join(registry.same_table(model_type))})"
        )
    refuse_switches(cfg, registry.architecture(model_type), traits.holds)
    return {**common_to_hf(cfg, registry.architecture(model_type)), **optional_keys(cfg, traits)}


def optional_keys(cfg: LlamaConfig, traits: Decoder) -> dict:
    """The optional config.json entries an architecture reads (traits.keys), as this model sets them."""
    out: dict = {}
    if traits.reads("attention_bias"):
        out["attention_bias"] = cfg.out_bias
    if traits.reads("qkv_bias"):
        out["qkv_bias"] = cfg.qkv_bias
    if traits.reads("mlp_bias"):
        out["mlp_bias"] = cfg.mlp_bias
    if traits.reads("sliding_window"):
        out["sliding_window"] = cfg.sliding_window or None
    if traits.reads("use_sliding_window"):
        out.update(use_sliding_window=False, sliding_window=None)
    if traits.reads("clip_qkv"):
        out["clip_qkv"] = None
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
        out["rope_scaling"] = positions.rope_to_hf(cfg.rope)
    return out


def _trained_length(cfg: LlamaConfig) -> int:
    """transformers' dynamic rope grows past max_position_embeddings, which must stay the trained length."""
    return cfg.rope.original_max if cfg.rope.type == "dynamic" and cfg.rope.original_max else cfg.max_seq_len


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


def rules(cfg: LlamaConfig, norm_offset: float = 0.0, fused: bool = False, experts=None, attention=None) -> list[Rule]:
    """The weight table. norm_offset: what transformers' norm weights lack of tfcli's (Gemma's 1 + w);
    fused: q/k/v and gate/up in one transformers projection each (Phi-3); experts(ours, layer): a
    mixture of experts' table in a layer that has one (hf/moe.py: expert_rules); attention(ours,
    layer): an attention's own table (DeepSeek's latent attention), in place of q/k/v/o's."""
    norm = lambda ours, theirs: rule(ours, theirs, offset=norm_offset)  # noqa: E731
    out = [rule("model.wte.weight", "model.embed_tokens.weight"), norm("model.ln_f.weight", "model.norm.weight")]
    if not cfg.tie_word_embeddings:
        out.append(rule("model.lm_head.weight", "lm_head.weight"))
    widths = (cfg.n_head * cfg.head_dim, cfg.n_kv_head * cfg.head_dim, cfg.n_kv_head * cfg.head_dim)
    for i in range(cfg.n_layer):
        ours, theirs = f"model.blocks.{i}", f"model.layers.{i}"
        out += [norm(f"{ours}.{a}.weight", f"{theirs}.{b}.weight") for a, b in NORMS[cfg.norms]]
        if attention is not None:
            out += attention(f"{ours}.attn", f"{theirs}.self_attn")
        else:
            out += attention_rules(cfg, f"{ours}.attn", f"{theirs}.self_attn", widths, fused)
        if cfg.has_experts(i):
            out += experts(f"{ours}.mlp", theirs)
        else:
            out += mlp_rules(f"{ours}.mlp", f"{theirs}.mlp", fused, cfg.mlp_bias)
        out += [
            norm(f"{ours}.attn.{n}.weight", f"{theirs}.self_attn.{n}.weight")
            for n in ("q_norm", "k_norm")
            if cfg.qk_norm
        ]
    return out


def attention_rules(cfg: LlamaConfig, ours: str, theirs: str, widths: tuple, fused: bool) -> list[Rule]:
    """One layer's q/k/v (fused into tfcli's qkv) and output projections."""
    qkv = [f"{theirs}.qkv_proj"] if fused else [f"{theirs}.{p}_proj" for p in "qkv"]
    split = () if fused else widths
    out = [rule(f"{ours}.qkv.weight", *(f"{n}.weight" for n in qkv), widths=split)]
    if cfg.qkv_bias:
        out.append(rule(f"{ours}.qkv.bias", *(f"{n}.bias" for n in qkv), widths=split))
    out.append(rule(f"{ours}.out.weight", f"{theirs}.o_proj.weight"))
    return out + ([rule(f"{ours}.out.bias", f"{theirs}.o_proj.bias")] if cfg.out_bias else [])


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
