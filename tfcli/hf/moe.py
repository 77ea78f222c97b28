"""Qwen3-MoE, Qwen2-MoE, Mixtral and OLMoE <-> transformers' *ForCausalLM, as llama-family decoders
whose feed-forward is a mixture of experts (models/moe.py) in the layers the config says.

transformers' checkpoints hold one gate / up / down projection per expert (`experts.{j}.gate_proj`,
Mixtral's `w1` / `w3` / `w2`); tfcli stacks them into (E, out, in) tensors and splits them again on
export. The four differ in the attention (Qwen3-MoE's per-head q/k norms, OLMoE's over the whole
projection, Qwen2-MoE's q/k/v biases, Mixtral's sliding window), in whether the router's top-k weights
are renormalised (Mixtral always; the others by norm_topk_prob), in Qwen2-MoE's shared expert, and in
the layers left dense (Qwen's decoder_sparse_step and mlp_only_layers).
"""

from __future__ import annotations

from ..errors import UserError
from ..models.llama import LlamaConfig
from . import llama, registry
from .convert import Export, Rule, rule
from .traits import Decoder, Experts

normalize = llama.normalize


def expert_rules(cfg: LlamaConfig, names: Experts, ours: str, layer: str) -> list[Rule]:
    """One layer's mixture: the router, the experts stacked (E, out, in) from one tensor each, and a
    shared expert with its gate where the model has one."""
    theirs = f"{layer}.{names.block}"
    out = [rule(f"{ours}.router.weight", f"{theirs}.gate.weight")]
    for mine, name in zip(("gate", "up", "down"), names.parts):
        experts = [f"{theirs}.experts.{j}.{name}.weight" for j in range(cfg.n_experts)]
        out.append(rule(f"{ours}.experts.{mine}", *experts, stack=True))
    if cfg.shared_expert_d_ff:
        out += llama.mlp_rules(f"{ours}.shared", f"{theirs}.{names.shared_block}")
    if cfg.shared_expert_d_ff and cfg.shared_expert_gate:
        out.append(rule(f"{ours}.shared_gate.weight", f"{theirs}.shared_expert_gate.weight"))
    return out


def config_from_hf(raw: dict, state=None) -> LlamaConfig:
    model_type = raw["model_type"]
    traits = registry.decoder_traits(model_type)
    kind = traits.experts
    if raw.get("router_jitter_noise"):
        raise UserError(f"{model_type}: router_jitter_noise {raw['router_jitter_noise']} is not implemented (set 0)")
    if raw.get("clip_qkv") is not None:
        raise UserError(f"{model_type}: clip_qkv {raw['clip_qkv']} is not implemented")
    if raw.get("use_sliding_window") and not traits.reads("sliding_window"):
        raise UserError(f"{model_type}: use_sliding_window is not implemented for mixtures of experts")
    both = traits.reads("attention_bias") and bool(raw.get("attention_bias", False))
    common = llama.common_config(raw)
    key = "num_experts" if "num_experts" in raw else "num_local_experts"  # transformers 5 writes either
    n_experts, per_token = raw[key], raw["num_experts_per_tok"]
    if not isinstance(n_experts, int) or n_experts < 1:  # 0 read as no mixture: a missing weight, named later
        raise UserError(f"{model_type}: config.json's {key} is {n_experts!r}; a mixture needs at least one expert")
    experts = dict(
        n_experts=n_experts,
        experts_per_token=per_token,
        expert_d_ff=raw.get("moe_intermediate_size") or common["d_ff"],
        norm_topk=kind.renormalises or bool(raw.get("norm_topk_prob", False)),
        router_aux_coef=float(raw.get("router_aux_loss_coef", kind.aux_default)),
    )
    if kind.qwen_layout:
        experts.update(
            sparse_step=raw.get("decoder_sparse_step", 1), dense_layers=tuple(raw.get("mlp_only_layers") or ())
        )
    if kind.shared_expert:
        experts["shared_expert_d_ff"] = raw.get("shared_expert_intermediate_size") or 0
    return LlamaConfig(
        **common,
        **experts,
        qkv_bias=bool(raw.get("qkv_bias", True)) if traits.reads("qkv_bias") else both,
        out_bias=both,
        qk_norm=traits.value("qk_norm"),
        qk_norm_whole=traits.value("qk_norm_whole"),
        sliding_window=(raw.get("sliding_window") or 0) if traits.reads("sliding_window") else 0,
    )


def config_to_hf(cfg: LlamaConfig) -> dict:
    model_type = cfg.hf_model_type
    traits = registry.decoder_traits(model_type)
    kind, arch = traits.experts, registry.architecture(model_type)
    llama.refuse_switches(cfg, arch, ("n_experts", *traits.holds))
    reason = _cannot_express(cfg, traits)
    if reason:
        raise UserError(
            f"this mixture of experts has {reason}, which transformers' {arch} cannot hold; set "
            f"model.hf_model_type to one that can ({', '.join(registry.same_table(model_type))})"
        )
    out = llama.common_to_hf(cfg, arch)
    out.update(num_experts_per_tok=cfg.experts_per_token, router_aux_loss_coef=cfg.router_aux_coef)
    out[kind.count_key] = cfg.n_experts
    if not kind.renormalises:
        out["norm_topk_prob"] = cfg.norm_topk
    if kind.qwen_layout:
        out.update(
            moe_intermediate_size=cfg.expert_d_ff,
            decoder_sparse_step=cfg.sparse_step,
            mlp_only_layers=list(cfg.dense_layers),
        )
    if kind.shared_expert:
        out["shared_expert_intermediate_size"] = cfg.shared_expert_d_ff
    return {**out, **llama.optional_keys(cfg, traits)}  # attention_bias: q/k/v's and o's are equal here


def _cannot_express(cfg: LlamaConfig, traits: Decoder) -> str:
    """Why the architecture of `traits` cannot hold this model exactly ("" if it can)."""
    kind = traits.experts
    if not cfg.n_experts:
        return "no experts"
    if cfg.shared_expert_d_ff and not kind.shared_expert:
        return "a shared expert"
    if (cfg.sparse_step != 1 or cfg.dense_layers) and not kind.qwen_layout:
        return "dense layers among its experts"
    if not kind.qwen_layout and cfg.expert_d_ff != cfg.d_ff:
        return "experts narrower than its d_ff"
    if kind.renormalises and not cfg.norm_topk:
        return "top-k weights that are not renormalised"
    if cfg.qk_norm != traits.value("qk_norm") or cfg.qk_norm_whole != traits.value("qk_norm_whole"):
        return "other q/k norms"
    if traits.reads("qkv_bias"):  # q/k/v biases of their own, none on the output (Qwen2-MoE)
        return "its biases" if cfg.out_bias or cfg.mlp_bias else ""
    if cfg.qkv_bias != cfg.out_bias or cfg.mlp_bias or (cfg.qkv_bias and not traits.reads("attention_bias")):
        return "its biases"
    if cfg.sliding_window and not traits.reads("sliding_window"):
        return "a sliding window"
    return ""


def rules(cfg: LlamaConfig) -> list[Rule]:
    names = registry.decoder_traits(cfg.hf_model_type).experts
    return llama.rules(cfg, experts=lambda ours, layer: expert_rules(cfg, names, ours, layer))


def export(backbone, recipe) -> Export:
    return llama.export(backbone, recipe, config_to_hf)
