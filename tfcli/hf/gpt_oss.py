"""gpt-oss <-> transformers' GptOssForCausalLM, as a llama-family decoder whose every feed-forward is a
mixture of experts (models/moe.py) and whose attention has sinks.

What sets it apart, each a LlamaConfig switch: a learned sink logit per head (`attn_sinks`), sliding
and full layers alternating by `layer_types`, biases on q/k/v/o, on the router and on every expert's
three projections (`expert_bias`), and experts gated by a clamped SwiGLU, (up + 1) * g * sigmoid(1.702
g) (`swiglu_limit`, `swiglu_alpha`). The router takes the top k of its logits and softmaxes them,
which is the softmax over all experts renormalised over the top k (`norm_topk`).

transformers holds each layer's experts in two stacks, `gate_up_proj` (E, D, 2F) with gate and up
interleaved column by column and `down_proj` (E, F, D), both (in, out), with (E, 2F) and (E, D)
biases; tfcli's are (E, out, in) and separate: the table strides and transposes (convert.Rule). The
released checkpoints hold the experts in MXFP4 (`*_blocks`, `*_scales`), dequantized on reading as
transformers' convert_moe_packed_tensors does.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..errors import UserError
from ..models.llama import LlamaConfig
from . import llama, positions, registry
from .convert import Export, Rule, rule

# MXFP4 (OCP microscaling): blocks of 32 fp4 e2m1 values, two to a byte (low nibble first), sharing
# one e8m0 exponent (bias 127)
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
PACKED = ("gate_up_proj", "down_proj")


def dequantize_mxfp4(blocks: Tensor, scales: Tensor, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """(E, out, in / 32, 16) uint8 blocks and (E, out, in / 32) uint8 exponents -> (E, in, out), the
    layout transformers holds gpt-oss's experts in (exact in bf16: each value is a 3-bit-mantissa
    number times a power of two)."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise UserError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    low, high = lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]  # (..., G, 16) each
    values = torch.stack((low, high), dim=-1).flatten(-2)  # (..., G, 32): low nibble first
    values = torch.ldexp(values, scales.to(torch.int32)[..., None] - 127)
    return values.flatten(-2).transpose(-2, -1).to(dtype).contiguous()  # (E, in, out)


def normalize(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """MXFP4 expert stacks (`<name>_blocks`, `<name>_scales`) -> `<name>` dequantized; meta tensors (a
    memory plan's shapes) become meta tensors of the dequantized shape."""
    state = llama.normalize(state)
    for name in [k for k in state if k.endswith(tuple(f"{p}_blocks" for p in PACKED))]:
        stem = name.removesuffix("_blocks")
        blocks, scales = state.pop(name), state.pop(f"{stem}_scales", None)
        if scales is None:
            raise UserError(f"not a matching checkpoint: {name} has no {stem}_scales")
        if blocks.is_meta:
            e, out, groups, _ = blocks.shape
            state[stem] = torch.empty(e, groups * 32, out, dtype=torch.bfloat16, device="meta")
        else:
            state[stem] = dequantize_mxfp4(blocks.to(torch.uint8), scales.to(torch.uint8))
    return state


def config_from_hf(raw: dict, state=None) -> LlamaConfig:
    quant = (raw.get("quantization_config") or {}).get("quant_method")
    if quant not in (None, "mxfp4"):
        raise UserError(f"gpt_oss: quantization {quant!r} is not read (tfcli reads bf16/fp32 and MXFP4 experts)")
    limit = raw.get("swiglu_limit", 7.0)
    if not limit or limit <= 0:
        raise UserError(f"gpt_oss: swiglu_limit {limit!r} is not implemented (gpt-oss clamps at a positive limit)")
    if raw.get("router_jitter_noise"):
        raise UserError(f"gpt_oss: router_jitter_noise {raw['router_jitter_noise']} is not implemented (set 0)")
    n = raw["num_hidden_layers"]
    common = llama.common_config(raw)
    bias = bool(raw.get("attention_bias", True))
    return LlamaConfig(
        **common,
        qkv_bias=bias,
        out_bias=bias,
        sliding_window=raw.get("sliding_window") or 0,
        layer_types=positions.layer_kinds(
            raw, ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
        ),
        n_experts=raw.get("num_local_experts") or raw.get("num_experts"),
        experts_per_token=raw["num_experts_per_tok"],
        expert_d_ff=common["d_ff"],
        norm_topk=True,
        router_aux_coef=float(raw.get("router_aux_loss_coef", 0.001)),
        attn_sinks=True,
        expert_bias=True,
        swiglu_limit=float(limit),
        swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)),
    )


def config_to_hf(cfg: LlamaConfig) -> dict:
    arch = registry.architecture(cfg.hf_model_type)
    held = ("n_experts", "layer_types", "attn_sinks", "expert_bias", "swiglu_limit", "swiglu_alpha")
    llama.refuse_switches(cfg, arch, held)
    reason = _cannot_express(cfg)
    if reason:
        raise UserError(f"this model has {reason}, which transformers' {arch} cannot hold")
    out = llama.common_to_hf(cfg, arch)
    out.update(
        num_local_experts=cfg.n_experts,
        num_experts_per_tok=cfg.experts_per_token,
        router_aux_loss_coef=cfg.router_aux_coef,
        attention_bias=cfg.out_bias,
        sliding_window=cfg.sliding_window or None,
        layer_types=[f"{kind}_attention" for kind in cfg.layer_types] or ["full_attention"] * cfg.n_layer,
        swiglu_limit=cfg.swiglu_limit,
        swiglu_alpha=cfg.swiglu_alpha,
    )
    return out


def _cannot_express(cfg: LlamaConfig) -> str:
    """Why GptOssForCausalLM cannot hold this model exactly ("" if it can)."""
    if not (cfg.n_experts and cfg.attn_sinks and cfg.expert_bias and cfg.swiglu_limit and cfg.norm_topk):
        return "no sinks, unbiased experts, another gate or other routing"
    if cfg.expert_d_ff != cfg.d_ff or cfg.qkv_bias != cfg.out_bias or cfg.mlp_bias or cfg.qk_norm:
        return "other experts, biases or norms"
    if cfg.sliding_window and not cfg.layer_types:
        return "a sliding window in every layer"
    return ""


def expert_rules(ours: str, layer: str) -> list[Rule]:
    """One layer's router and experts: gate and up strided out of gate_up_proj, all transposed."""
    theirs = f"{layer}.mlp"
    out = [rule(f"{ours}.router.{p}", f"{theirs}.router.{p}") for p in ("weight", "bias")]
    for j, part in enumerate(("gate", "up")):
        out.append(rule(f"{ours}.experts.{part}", f"{theirs}.experts.gate_up_proj", transpose=True, strided=(j, 2)))
        out.append(rule(f"{ours}.experts.{part}_bias", f"{theirs}.experts.gate_up_proj_bias", strided=(j, 2)))
    out.append(rule(f"{ours}.experts.down", f"{theirs}.experts.down_proj", transpose=True))
    out.append(rule(f"{ours}.experts.down_bias", f"{theirs}.experts.down_proj_bias"))
    return out


def rules(cfg: LlamaConfig) -> list[Rule]:
    out = llama.rules(cfg, experts=expert_rules)
    return out + [rule(f"model.blocks.{i}.attn.sinks", f"model.layers.{i}.self_attn.sinks") for i in range(cfg.n_layer)]


def export(backbone, recipe) -> Export:
    return llama.export(backbone, recipe, config_to_hf)
