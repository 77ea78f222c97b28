"""DeepSeek-V3 <-> transformers' DeepseekV3ForCausalLM (every checkpoint of the architecture whose
config.json says model_type deepseek_v3; Kimi K2 shares the architecture under a type of its own,
kimi_k2, which transformers does not ship), as a llama-family decoder with multi-head latent
attention (models/latent_attention.py) and a mixture of experts after its first dense layers.

Its switches: the latent attention's ranks and head widths (`kv_lora_rank`, `q_lora_rank`,
`rope_head_dim`, `v_head_dim`, DeepSeek's interleaved rotary pairs `rope_interleave`), the query scale
with yarn's mscale squared (`attn_scale`), the sigmoid router with its correction bias, chosen among the
best `topk_group` of `n_group` groups and scaled by `routed_scaling_factor`, shared experts added
ungated (`shared_expert_gate` off), and `first_k_dense_replace` dense layers first. transformers
trains it with no load-balancing loss; tfcli neither (the correction bias stays as read).

Checkpoints name each expert apart (`experts.{j}.gate_proj`, as Qwen2-MoE's), which transformers fuses
on loading; tfcli stacks them (E, out, in). The released DeepSeek-V3 weights are FP8
(e4m3) with one inverse scale per 128 x 128 block (`weight_scale_inv`): dequantized on reading, as
transformers' FineGrainedFP8 path does without a GPU.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..errors import UserError
from ..models.llama import LlamaConfig
from . import llama, moe, positions, registry
from .convert import Export, Rule, rule

FP8_BLOCK = (128, 128)  # quantization_config.weight_block_size, the one tfcli reads
HELD = (
    "n_experts", "dense_layers", "kv_lora_rank", "q_lora_rank", "rope_head_dim", "v_head_dim", "rope_interleave",
    "router_score", "expert_groups", "expert_groups_used", "routed_scale", "shared_expert_gate", "attn_scale",
)  # fmt: skip


def config_from_hf(raw: dict, state=None) -> LlamaConfig:
    n_head = raw["num_attention_heads"]
    if (raw.get("num_key_value_heads") or n_head) != n_head:
        raise UserError(
            f"deepseek_v3: num_key_value_heads {raw['num_key_value_heads']} is not implemented (MLA has one per head)"
        )
    quant = raw.get("quantization_config") or {}
    if quant.get("quant_method") not in (None, "fp8") or (
        quant.get("quant_method") == "fp8" and tuple(quant.get("weight_block_size") or FP8_BLOCK) != FP8_BLOCK
    ):
        raise UserError(
            f"deepseek_v3: quantization {quant.get('quant_method')!r} with blocks {quant.get('weight_block_size')} "
            "is not read (tfcli reads bf16/fp32 and FP8 in 128 x 128 blocks)"
        )
    nope, rope = raw["qk_nope_head_dim"], raw["qk_rope_head_dim"]
    common = llama.common_config({**raw, "head_dim": nope + rope, "num_key_value_heads": n_head})
    shared = raw.get("n_shared_experts") or 0
    return LlamaConfig(
        **common,
        qkv_bias=False,
        out_bias=bool(raw.get("attention_bias", False)),
        kv_lora_rank=raw["kv_lora_rank"],
        q_lora_rank=raw.get("q_lora_rank") or 0,
        rope_head_dim=rope,
        v_head_dim=raw.get("v_head_dim") or nope + rope,
        rope_interleave=bool(raw.get("rope_interleave", True)),
        attn_scale=positions.latent_attention_scale(raw, nope + rope),
        n_experts=raw.get("n_routed_experts") or raw.get("num_local_experts"),
        experts_per_token=raw["num_experts_per_tok"],
        expert_d_ff=raw["moe_intermediate_size"],
        shared_expert_d_ff=raw["moe_intermediate_size"] * shared,
        shared_expert_gate=False,
        dense_layers=tuple(range(min(raw.get("first_k_dense_replace") or 0, raw["num_hidden_layers"]))),
        norm_topk=bool(raw.get("norm_topk_prob", True)),
        router_score="sigmoid",
        expert_groups=raw.get("n_group") or 1,
        expert_groups_used=raw.get("topk_group") or 1,
        routed_scale=float(raw.get("routed_scaling_factor", 1.0)),
    )


def config_to_hf(cfg: LlamaConfig) -> dict:
    arch = registry.architecture(cfg.hf_model_type)
    llama.refuse_switches(cfg, arch, HELD)
    reason = _cannot_express(cfg)
    if reason:
        raise UserError(f"this model has {reason}, which transformers' {arch} cannot hold")
    out = llama.common_to_hf(cfg, arch)
    if cfg.rope.type != "default":
        out["rope_scaling"] = positions.latent_rope_to_hf(cfg.rope, cfg.attn_scale, cfg.head_dim)
    shared = cfg.shared_expert_d_ff // cfg.expert_d_ff
    out.update(
        num_key_value_heads=cfg.n_head,
        head_dim=cfg.rope_head_dim,  # transformers' rotary width for this architecture
        qk_nope_head_dim=cfg.head_dim - cfg.rope_head_dim,
        qk_rope_head_dim=cfg.rope_head_dim,
        v_head_dim=cfg.v_head_dim,
        kv_lora_rank=cfg.kv_lora_rank,
        q_lora_rank=cfg.q_lora_rank or None,
        rope_interleave=cfg.rope_interleave,
        attention_bias=cfg.out_bias,
        n_routed_experts=cfg.n_experts,
        num_experts_per_tok=cfg.experts_per_token,
        moe_intermediate_size=cfg.expert_d_ff,
        n_shared_experts=shared,
        first_k_dense_replace=len(cfg.dense_layers),
        norm_topk_prob=cfg.norm_topk,
        n_group=cfg.expert_groups,
        topk_group=cfg.expert_groups_used,
        routed_scaling_factor=cfg.routed_scale,
    )
    return out


def _cannot_express(cfg: LlamaConfig) -> str:
    """Why DeepseekV3ForCausalLM cannot hold this model exactly ("" if it can)."""
    if not (cfg.kv_lora_rank and cfg.n_experts and cfg.router_score == "sigmoid") or cfg.shared_expert_gate:
        return "no latent attention, other routing or a gated shared expert"
    if cfg.dense_layers != tuple(range(len(cfg.dense_layers))) or cfg.sparse_step != 1:
        return "dense layers other than its first ones"
    if cfg.shared_expert_d_ff % cfg.expert_d_ff or cfg.qkv_bias or cfg.mlp_bias or cfg.qk_norm:
        return "shared experts of another width, or other biases or norms"
    rope = {"rope_parameters": positions.latent_rope_to_hf(cfg.rope, cfg.attn_scale, cfg.head_dim)}
    if abs(cfg.attn_scale - positions.latent_attention_scale(rope, cfg.head_dim)) > 1e-9 * cfg.attn_scale:
        return "another query scale"
    if cfg.sliding_window or cfg.layer_types:
        return "a sliding window"
    return ""


def attention_rules(cfg: LlamaConfig, ours: str, theirs: str) -> list[Rule]:
    """One layer's latent attention: the query's projection(s) and norm, the latent's, the output."""
    out = []
    if cfg.q_lora_rank:
        out += [
            rule(f"{ours}.q_a.weight", f"{theirs}.q_a_proj.weight"),
            rule(f"{ours}.q_a_norm.weight", f"{theirs}.q_a_layernorm.weight"),
            rule(f"{ours}.q_b.weight", f"{theirs}.q_b_proj.weight"),
        ]
    else:
        out.append(rule(f"{ours}.q.weight", f"{theirs}.q_proj.weight"))
    out += [
        rule(f"{ours}.kv_a.weight", f"{theirs}.kv_a_proj_with_mqa.weight"),
        rule(f"{ours}.kv_norm.weight", f"{theirs}.kv_a_layernorm.weight"),
        rule(f"{ours}.kv_b.weight", f"{theirs}.kv_b_proj.weight"),
        rule(f"{ours}.out.weight", f"{theirs}.o_proj.weight"),
    ]
    if cfg.out_bias:
        named = [("q_a", "q_a_proj")] if cfg.q_lora_rank else []
        named += [("kv_a", "kv_a_proj_with_mqa"), ("out", "o_proj")]
        out += [rule(f"{ours}.{a}.bias", f"{theirs}.{b}.bias") for a, b in named]
    return out


def expert_rules(cfg: LlamaConfig, ours: str, layer: str) -> list[Rule]:
    """One layer's mixture as the other mixtures' (hf/moe.py: the router, the experts stacked, the
    shared experts), and the router's correction bias (zeros where a checkpoint has none)."""
    names = registry.decoder_traits(cfg.hf_model_type).experts
    bias = rule(f"{ours}.score_bias", f"{layer}.mlp.gate.e_score_correction_bias", optional=True)
    return [*moe.expert_rules(cfg, names, ours, layer), bias]


def rules(cfg: LlamaConfig) -> list[Rule]:
    return llama.rules(
        cfg,
        experts=lambda ours, layer: expert_rules(cfg, ours, layer),
        attention=lambda ours, theirs: attention_rules(cfg, ours, theirs),
    )


def normalize(state: dict) -> dict:
    """A bare model's keys get the causal LM's prefix, FP8 weights are dequantized; the multi-token-
    prediction layers released checkpoints carry past num_hidden_layers (transformers ignores them
    too) are left unread."""
    state = llama.normalize(state)
    for name in [k for k in state if k.endswith(".weight_scale_inv")]:
        scale, weight = state.pop(name), f"{name.removesuffix('_scale_inv')}"
        if weight in state and not state[weight].is_meta:
            state[weight] = dequantize_fp8(state[weight], scale)
        elif weight in state:
            state[weight] = torch.empty(state[weight].shape, dtype=torch.float32, device="meta")
    return state


def dequantize_fp8(weight: Tensor, scale_inv: Tensor) -> Tensor:
    """(out, in) FP8 weights times their (ceil(out / 128), ceil(in / 128)) inverse scales -> fp32 (the
    run then holds them in its own dtype)."""
    rows, cols = FP8_BLOCK
    out, width = weight.shape
    if scale_inv.shape != (-(-out // rows), -(-width // cols)):
        raise UserError(f"FP8 weight {tuple(weight.shape)} and its scales {tuple(scale_inv.shape)} do not match")
    scale = scale_inv.float().repeat_interleave(rows, 0)[:out].repeat_interleave(cols, 1)[:, :width]
    return weight.float() * scale


def export(backbone, recipe) -> Export:
    return llama.export(backbone, recipe, config_to_hf)
