"""The vision towers of vision-language models <-> tfcli's ViT: CLIP's (LLaVA), SigLIP's (LLaVA),
Idefics3's (SigLIP's, as SmolVLM holds it), and transformers' ViTModel (LLaVA reads any vision model:
tfcli's own ViT, an MAE run's, is written as one). One weight table, their config maps.

CLIP has a class embedding (D,) and a position table (N + 1, D), no patch bias and a LayerNorm before
the blocks (`pre_layrnorm`); SigLIP has no [CLS], a patch bias and a position table (N, D). Their
blocks are the same: layer_norm1, q/k/v/out_proj with biases, layer_norm2, mlp.fc1/fc2. The pooling
head a SigLIP vision model may carry is read by no vision-language model and is not kept.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from ..errors import UserError
from ..models.vit import ViTConfig, sincos_2d
from . import vit
from .convert import Rule, rule

CLIP, SIGLIP, IDEFICS3, VIT = "clip_vision_model", "siglip_vision_model", "idefics3_vision", "vit"
ACTIVATIONS = {"quick_gelu": "quick_gelu", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
_BLOCK = (
    ("norm_attn", "layer_norm1"),
    ("norm_mlp", "layer_norm2"),
    ("attn.out", "self_attn.out_proj"),
    ("mlp.up", "mlp.fc1"),
    ("mlp.down", "mlp.fc2"),
)


def config_from_hf(raw: dict) -> ViTConfig:
    """A vision tower's config dict -> ViTConfig (the MAE decoder fields keep their defaults)."""
    kind = raw.get("model_type", CLIP)
    kind = IDEFICS3 if kind == "smolvlm_vision" else kind  # SmolVLM's tower is Idefics3's under another name
    if kind not in (CLIP, SIGLIP, IDEFICS3):
        raise UserError(f"vision tower {kind!r} is not supported (tfcli reads {CLIP}, {SIGLIP}, {IDEFICS3})")
    act = raw.get("hidden_act", "quick_gelu" if kind == CLIP else "gelu_pytorch_tanh")
    if act not in ACTIVATIONS:
        raise UserError(f"vision tower activation {act!r} is not supported ({', '.join(ACTIVATIONS)})")
    clip = kind == CLIP
    return ViTConfig(
        image_size=raw.get("image_size", 224),
        patch_size=raw.get("patch_size", 32 if clip else 16),
        channels=raw.get("num_channels", 3),
        n_layer=raw.get("num_hidden_layers", 12),
        n_head=raw.get("num_attention_heads", 12),
        d_model=raw.get("hidden_size", 768),
        d_ff=raw.get("intermediate_size", 3072),
        dropout=raw.get("attention_dropout", 0.0),
        layer_norm_eps=raw.get("layer_norm_eps", 1e-5 if clip else 1e-6),
        pos_embed="learned",
        cls_token=clip,
        patch_bias=not clip,
        pre_norm=clip,
        activation=ACTIVATIONS[act],  # type: ignore[arg-type]
    )


def kind_of(cfg: ViTConfig) -> str:
    """The transformers tower a ViT is: CLIP's, SigLIP's, or (tfcli's own: [CLS], a patch bias, no norm
    before the blocks, as an MAE run has it) transformers' ViTModel, which LLaVA reads as well; one line
    for what none holds."""
    if cfg.stem != "patch":
        raise UserError("a ViT with a convolutional stem (model.stem conv) has no transformers vision tower")
    switches = (cfg.cls_token, cfg.patch_bias, cfg.pre_norm)
    kinds = {(True, False, True): CLIP, (False, True, False): SIGLIP, (True, True, False): VIT}
    if switches not in kinds or (kinds[switches] == VIT and cfg.activation != "gelu"):
        raise UserError(
            "this ViT is none of CLIP's tower ([CLS], no patch bias, a norm before the blocks), SigLIP's (no [CLS], "
            "a patch bias) or transformers' ViTModel ([CLS], a patch bias, exact GELU): no vision-language model holds it"
        )
    return kinds[switches]


def vit_config(raw: dict, state: dict, theirs: str) -> ViTConfig:
    """A ViTModel tower's config (its positions sin-cos where the weights under `theirs` are MAE's)."""
    return vit.config_from_hf(
        raw, {f"vit.{k[len(theirs) + 1 :]}": v for k, v in state.items() if k.startswith(f"{theirs}.")}
    )


def extra_tensors(cfg: ViTConfig, theirs: str) -> dict[str, Tensor]:
    """What a ViTModel tower stores that tfcli computes (MAE's fixed sin-cos positions) or has no use
    for: the pooler transformers' ViTModel builds from its config, which a vision-language model never
    reads (it reads hidden states), written as zeros so that the tower loads whole."""
    if kind_of(cfg) != VIT:
        return {}
    d = cfg.d_model
    out = {f"{theirs}.pooler.dense.weight": torch.zeros(d, d), f"{theirs}.pooler.dense.bias": torch.zeros(d)}
    if cfg.pos_embed == "sincos":
        out[f"{theirs}.embeddings.position_embeddings"] = sincos_2d(cfg.grid, cfg.d_model)
    return out


def config_to_hf(cfg: ViTConfig, model_type: str) -> dict:
    if model_type == VIT:
        return {"model_type": VIT, **vit.common(cfg)}
    act = next(k for k, v in ACTIVATIONS.items() if v == cfg.activation)
    out = {
        "model_type": model_type,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff,
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "num_channels": cfg.channels,
        "image_size": cfg.image_size,
        "patch_size": cfg.patch_size,
        "hidden_act": act,
        "layer_norm_eps": cfg.layer_norm_eps,
        "attention_dropout": cfg.dropout,
    }
    return {**out, "vision_use_head": False} if model_type == SIGLIP else out


def rules(cfg: ViTConfig, ours: str, theirs: str) -> list[Rule]:
    """The tower's table: tfcli's `{ours}.*` (a ViT) and transformers' `{theirs}.*` (its vision_model)."""
    if kind_of(cfg) == VIT:  # ViTModel's names, as hf/vit.py has them under `vit.`
        return [
            replace(r, ours=f"{ours}.{r.ours[len('model.') :]}", theirs=tuple(f"{theirs}.{t[4:]}" for t in r.theirs))
            for r in vit.rules(cfg)
            if r.ours.startswith("model.")
        ]
    out = [
        rule(f"{ours}.patch_embed.weight", f"{theirs}.embeddings.patch_embedding.weight"),
        rule(f"{ours}.pos_embed", f"{theirs}.embeddings.position_embedding.weight", lead=1),
        rule(f"{ours}.norm.weight", f"{theirs}.post_layernorm.weight"),
        rule(f"{ours}.norm.bias", f"{theirs}.post_layernorm.bias"),
    ]
    if cfg.patch_bias:
        out.append(rule(f"{ours}.patch_embed.bias", f"{theirs}.embeddings.patch_embedding.bias"))
    if cfg.cls_token:
        out.append(rule(f"{ours}.cls_token", f"{theirs}.embeddings.class_embedding", lead=2))
    if cfg.pre_norm:
        out += [rule(f"{ours}.pre_norm.{w}", f"{theirs}.pre_layrnorm.{w}") for w in ("weight", "bias")]
    for i in range(cfg.n_layer):
        a, b = f"{ours}.blocks.{i}", f"{theirs}.encoder.layers.{i}"
        for w in ("weight", "bias"):
            out.append(rule(f"{a}.attn.qkv.{w}", *(f"{b}.self_attn.{p}_proj.{w}" for p in "qkv")))
            out += [rule(f"{a}.{o}.{w}", f"{b}.{t}.{w}") for o, t in _BLOCK]
    return out
