"""The vision towers of vision-language models <-> tfcli's ViT: CLIP's (LLaVA), SigLIP's (LLaVA),
Idefics3's (SigLIP's, as SmolVLM holds it), and transformers' ViTModel (LLaVA reads any vision model:
tfcli's own ViT, an MAE run's, is written as one). One weight table, their config maps.

CLIP has a class embedding (D,) and a position table (N + 1, D), no patch bias and a LayerNorm before
the blocks (`pre_layrnorm`); SigLIP has no [CLS], a patch bias and a position table (N, D). Their
blocks are the same: layer_norm1, q/k/v/out_proj with biases, layer_norm2, mlp.fc1/fc2. The pooling
head a SigLIP vision model may carry is read by no vision-language model and is not kept.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from ..errors import UserError
from ..models.vit import ViTConfig, sincos_2d
from . import vit
from .convert import Rule, rule

CLIP, SIGLIP, IDEFICS3, VIT = "clip_vision_model", "siglip_vision_model", "idefics3_vision", "vit"
CLIP_MEAN, CLIP_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
HALF = (0.5, 0.5, 0.5)


@dataclass(frozen=True)
class Tower:
    """A transformers vision tower, as data: tfcli's ViT switches for it, its config's defaults, and
    the image processing transformers gives it where a directory names none."""

    cls_token: bool  # a class embedding ([CLS])
    patch_bias: bool  # the patch embedding has a bias
    pre_norm: bool  # a LayerNorm before the blocks (CLIP's pre_layrnorm)
    activation: str = "gelu_pytorch_tanh"  # hidden_act where the config names none
    patch_size: int = 16
    eps: float = 1e-6
    resample: int = 2  # PIL's resampling filter (bicubic 3, bilinear 2, lanczos 1)
    mean: tuple[float, float, float] = HALF
    std: tuple[float, float, float] = HALF
    resize: str = "shortest_edge"  # then a center crop; "square" (SigLIP); "tiles" (Idefics3's)
    processor: str = "ViTImageProcessor"  # the image processor class an export names
    config_extra: tuple[tuple[str, Any], ...] = ()  # entries its config.json gets on export
    vit_model: bool = False  # transformers' ViTModel: hf/vit.py's names and config


TOWERS = {
    CLIP: Tower(True, False, True, "quick_gelu", 32, 1e-5, 3, CLIP_MEAN, CLIP_STD, processor="CLIPImageProcessor"),
    SIGLIP: Tower(
        False,
        True,
        False,
        resize="square",
        processor="SiglipImageProcessor",
        config_extra=(("vision_use_head", False),),
    ),
    IDEFICS3: Tower(False, True, False, resample=1, resize="tiles"),
    VIT: Tower(True, True, False, activation="gelu", vit_model=True),
}
ALIASES = {"smolvlm_vision": IDEFICS3}  # SmolVLM's tower is Idefics3's under another name


def is_vit_model(model_type: str | None) -> bool:
    """Whether a tower's config is transformers' ViTModel's (read by hf/vit.py's table)."""
    return model_type in TOWERS and TOWERS[model_type].vit_model


def tower(model_type: str | None) -> Tower:
    """A vision tower's conventions by its config's model_type (CLIP's where it names none)."""
    return TOWERS[ALIASES.get(model_type or CLIP, model_type or CLIP)]


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
    kind = ALIASES.get(raw.get("model_type", CLIP), raw.get("model_type", CLIP))
    if kind not in TOWERS or TOWERS[kind].vit_model:
        raise UserError(f"vision tower {kind!r} is not supported (tfcli reads {CLIP}, {SIGLIP}, {IDEFICS3})")
    t = TOWERS[kind]
    act = raw.get("hidden_act", t.activation)
    if act not in ACTIVATIONS:
        raise UserError(f"vision tower activation {act!r} is not supported ({', '.join(ACTIVATIONS)})")
    return ViTConfig(
        image_size=raw.get("image_size", 224),
        patch_size=raw.get("patch_size", t.patch_size),
        channels=raw.get("num_channels", 3),
        n_layer=raw.get("num_hidden_layers", 12),
        n_head=raw.get("num_attention_heads", 12),
        d_model=raw.get("hidden_size", 768),
        d_ff=raw.get("intermediate_size", 3072),
        dropout=raw.get("attention_dropout", 0.0),
        layer_norm_eps=raw.get("layer_norm_eps", t.eps),
        pos_embed="learned",
        cls_token=t.cls_token,
        patch_bias=t.patch_bias,
        pre_norm=t.pre_norm,
        activation=ACTIVATIONS[act],  # type: ignore[arg-type]
    )


def kind_of(cfg: ViTConfig) -> str:
    """The transformers tower a ViT is: CLIP's, SigLIP's, or (tfcli's own: [CLS], a patch bias, no norm
    before the blocks, as an MAE run has it) transformers' ViTModel, which LLaVA reads as well; one line
    for what none holds."""
    if cfg.stem != "patch":
        raise UserError("a ViT with a convolutional stem (model.stem conv) has no transformers vision tower")
    switches = (cfg.cls_token, cfg.patch_bias, cfg.pre_norm)
    kinds: dict[tuple, str] = {}
    for name, t in TOWERS.items():  # Idefics3's tower has SigLIP's switches: SigLIP's comes first
        kinds.setdefault((t.cls_token, t.patch_bias, t.pre_norm), name)
    vit_model = switches in kinds and TOWERS[kinds[switches]].vit_model
    if switches not in kinds or (vit_model and cfg.activation != TOWERS[VIT].activation):
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
    if not TOWERS[kind_of(cfg)].vit_model:
        return {}
    d = cfg.d_model
    out = {f"{theirs}.pooler.dense.weight": torch.zeros(d, d), f"{theirs}.pooler.dense.bias": torch.zeros(d)}
    if cfg.pos_embed == "sincos":
        out[f"{theirs}.embeddings.position_embeddings"] = sincos_2d(cfg.grid, cfg.d_model)
    return out


def config_to_hf(cfg: ViTConfig, model_type: str) -> dict:
    t = tower(model_type)
    if t.vit_model:
        return {"model_type": model_type, **vit.common(cfg)}
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
    return {**out, **dict(t.config_extra)}


def rules(cfg: ViTConfig, ours: str, theirs: str) -> list[Rule]:
    """The tower's table: tfcli's `{ours}.*` (a ViT) and transformers' `{theirs}.*` (its vision_model)."""
    if TOWERS[kind_of(cfg)].vit_model:  # ViTModel's names, as hf/vit.py has them under `vit.`
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
