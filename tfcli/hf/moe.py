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

from dataclasses import dataclass

from ..errors import UserError
from ..models.llama import LlamaConfig
from . import llama
from .convert import Export, Rule, rule

normalize = llama.normalize
AUX_DEFAULTS = {
    "qwen3_moe": 0.001,
    "qwen2_moe": 0.001,
    "mixtral": 0.001,
    "olmoe": 0.01,
}  # transformers' (a GGUF has none)


@dataclass(frozen=True)
class ExpertNames:
    """How an architecture names a mixture's parts under each layer."""

    block: str  # the feed-forward module: "mlp" (Mixtral: "block_sparse_moe")
    parts: tuple[str, str, str]  # the experts' gate, up, down projections

    def rules(self, cfg: LlamaConfig, ours: str, layer: str) -> list[Rule]:
        theirs = f"{layer}.{self.block}"
        out = [rule(f"{ours}.router.weight", f"{theirs}.gate.weight")]
        for mine, name in zip(("gate", "up", "down"), self.parts):
            experts = [f"{theirs}.experts.{j}.{name}.weight" for j in range(cfg.n_experts)]
            out.append(rule(f"{ours}.experts.{mine}", *experts, stack=True))
        if cfg.shared_expert_d_ff:
            out += llama.mlp_rules(f"{ours}.shared", f"{theirs}.shared_expert")
            out.append(rule(f"{ours}.shared_gate.weight", f"{theirs}.shared_expert_gate.weight"))
        return out


NAMES = {
    "mixtral": ExpertNames("block_sparse_moe", ("w1", "w3", "w2")),
    **{t: ExpertNames("mlp", ("gate_proj", "up_proj", "down_proj")) for t in ("qwen3_moe", "qwen2_moe", "olmoe")},
}


def config_from_hf(raw: dict, state=None) -> LlamaConfig:
    model_type = raw["model_type"]
    if raw.get("router_jitter_noise"):
        raise UserError(f"{model_type}: router_jitter_noise {raw['router_jitter_noise']} is not implemented (set 0)")
    if raw.get("clip_qkv") is not None:
        raise UserError(f"{model_type}: clip_qkv {raw['clip_qkv']} is not implemented")
    if raw.get("use_sliding_window") and model_type != "mixtral":
        raise UserError(f"{model_type}: use_sliding_window is not implemented for mixtures of experts")
    both = bool(raw.get("attention_bias", False))
    common = llama.common_config(raw)
    key = "num_experts" if "num_experts" in raw else "num_local_experts"  # transformers 5 writes either
    n_experts, per_token = raw[key], raw["num_experts_per_tok"]
    if not isinstance(n_experts, int) or n_experts < 1:  # 0 read as no mixture: a missing weight, named later
        raise UserError(f"{model_type}: config.json's {key} is {n_experts!r}; a mixture needs at least one expert")
    experts = dict(
        n_experts=n_experts,
        experts_per_token=per_token,
        expert_d_ff=raw.get("moe_intermediate_size") or common["d_ff"],
        norm_topk=model_type == "mixtral" or bool(raw.get("norm_topk_prob", False)),
        router_aux_coef=float(raw.get("router_aux_loss_coef", AUX_DEFAULTS[model_type])),
    )
    if model_type in ("qwen3_moe", "qwen2_moe"):
        experts.update(
            sparse_step=raw.get("decoder_sparse_step", 1), dense_layers=tuple(raw.get("mlp_only_layers") or ())
        )
    if model_type == "qwen2_moe":
        experts["shared_expert_d_ff"] = raw.get("shared_expert_intermediate_size") or 0
    return LlamaConfig(
        **common,
        **experts,
        qkv_bias=bool(raw.get("qkv_bias", True)) if model_type == "qwen2_moe" else both,
        out_bias=both and model_type != "qwen2_moe",
        qk_norm=model_type in ("qwen3_moe", "olmoe"),
        qk_norm_whole=model_type == "olmoe",
        sliding_window=(raw.get("sliding_window") or 0) if model_type == "mixtral" else 0,
    )


def config_to_hf(cfg: LlamaConfig) -> dict:
    model_type = cfg.hf_model_type
    arch = llama.architecture(model_type)
    llama.refuse_switches(cfg, arch, ("n_experts", "qk_norm_whole") if model_type == "olmoe" else ("n_experts",))
    reason = _cannot_express(cfg, model_type)
    if reason:
        raise UserError(
            f"this mixture of experts has {reason}, which transformers' {arch} cannot hold; set "
            f"model.hf_model_type to one that can ({', '.join(AUX_DEFAULTS)})"
        )
    out = llama.common_to_hf(cfg, arch)
    out.update(num_experts_per_tok=cfg.experts_per_token, router_aux_loss_coef=cfg.router_aux_coef)
    if model_type == "mixtral":
        out.update(num_local_experts=cfg.n_experts, sliding_window=cfg.sliding_window or None)
        return out
    out.update(num_experts=cfg.n_experts, norm_topk_prob=cfg.norm_topk)
    if model_type == "olmoe":
        out.update(attention_bias=cfg.qkv_bias, clip_qkv=None)
        return out
    out.update(
        moe_intermediate_size=cfg.expert_d_ff,
        decoder_sparse_step=cfg.sparse_step,
        mlp_only_layers=list(cfg.dense_layers),
        use_sliding_window=False,
        sliding_window=None,
    )
    if model_type == "qwen2_moe":
        out.update(shared_expert_intermediate_size=cfg.shared_expert_d_ff, qkv_bias=cfg.qkv_bias)
    else:
        out["attention_bias"] = cfg.qkv_bias
    return out


def _cannot_express(cfg: LlamaConfig, model_type: str) -> str:
    """Why `model_type` cannot hold this model exactly ("" if it can)."""
    if not cfg.n_experts:
        return "no experts"
    qwen = model_type in ("qwen3_moe", "qwen2_moe")
    if cfg.shared_expert_d_ff and model_type != "qwen2_moe":
        return "a shared expert"
    if (cfg.sparse_step != 1 or cfg.dense_layers) and not qwen:
        return "dense layers among its experts"
    if not qwen and cfg.expert_d_ff != cfg.d_ff:
        return "experts narrower than its d_ff"
    if model_type == "mixtral" and not cfg.norm_topk:
        return "top-k weights that are not renormalised"
    if cfg.qk_norm != (model_type in ("qwen3_moe", "olmoe")) or cfg.qk_norm_whole != (model_type == "olmoe"):
        return "other q/k norms"
    if model_type == "qwen2_moe":
        return "its biases" if cfg.out_bias or cfg.mlp_bias else ""
    if cfg.qkv_bias != cfg.out_bias or cfg.mlp_bias:
        return "its biases"
    if cfg.sliding_window and model_type != "mixtral":
        return "a sliding window"
    return ""


def rules(cfg: LlamaConfig) -> list[Rule]:
    return llama.rules(cfg, experts=NAMES[cfg.hf_model_type])


def export(backbone, recipe) -> Export:
    return llama.export(backbone, recipe, config_to_hf)
