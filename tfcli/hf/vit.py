"""ViT and ViT-MAE <-> transformers' ViTModel / ViTForImageClassification / ViTMAEForPreTraining:
the weight table and config map.

The table uses the names transformers writes to disk (4.x style, which 5.x also writes); 5.x
in-memory names are mapped onto them. q/k/v become tfcli's fused qkv. Fixed 2-D sin-cos position
embeddings are recognised on import (and recomputed, not stored in tfcli); export writes them out.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..errors import UserError
from ..models.vit import ViTConfig, sincos_2d
from .convert import Export, Rule, json_text, renamed, rule

_BLOCK = [
    ("norm_attn", "layernorm_before"),
    ("norm_mlp", "layernorm_after"),
    ("attn.out", "attention.output.dense"),
    ("mlp.up", "intermediate.dense"),
    ("mlp.down", "output.dense"),
]
_MODERN = [  # transformers 5.x module names -> the on-disk names
    (r"^vit\.layers\.", "vit.encoder.layer."),
    (r"^decoder\.decoder_layers\.", "decoder.decoder_encoder.layer."),
    (r"\.attention\.q_proj\.", ".attention.attention.query."),
    (r"\.attention\.k_proj\.", ".attention.attention.key."),
    (r"\.attention\.v_proj\.", ".attention.attention.value."),
    (r"\.attention\.o_proj\.", ".attention.output.dense."),
    (r"\.mlp\.fc1\.", ".intermediate.dense."),
    (r"\.mlp\.fc2\.", ".output.dense."),
]
_ENCODER = "vit.embeddings.position_embeddings"
_DECODER = "decoder.decoder_pos_embed"


def config_from_hf(raw: dict, state: dict) -> ViTConfig:
    """A ViTMAEConfig or ViTConfig dict -> ViTConfig (decoder fields keep their defaults for a ViT);
    positions are sin-cos when the checkpoint's equal MAE's fixed ones, else learned."""
    if raw.get("hidden_act", "gelu") != "gelu" or not raw.get("qkv_bias", True):
        raise UserError("only ViTs with exact GELU and q/k/v biases are supported")
    d = ViTConfig()
    cfg = ViTConfig(
        image_size=raw["image_size"],
        patch_size=raw["patch_size"],
        channels=raw.get("num_channels", 3),
        n_layer=raw["num_hidden_layers"],
        n_head=raw["num_attention_heads"],
        d_model=raw["hidden_size"],
        d_ff=raw["intermediate_size"],
        dropout=raw.get("hidden_dropout_prob", 0.0),
        layer_norm_eps=raw.get("layer_norm_eps", 1e-12),
        pos_embed="learned",
        decoder_d_model=raw.get("decoder_hidden_size", d.decoder_d_model),
        decoder_n_layer=raw.get("decoder_num_hidden_layers", d.decoder_n_layer),
        decoder_n_head=raw.get("decoder_num_attention_heads", d.decoder_n_head),
        decoder_d_ff=raw.get("decoder_intermediate_size", d.decoder_d_ff),
        mask_ratio=raw.get("mask_ratio", d.mask_ratio),
        norm_pix_loss=raw.get("norm_pix_loss", d.norm_pix_loss),
    )
    return replace(cfg, pos_embed="sincos") if _positions_are_sincos(state, cfg) else cfg


def _positions_are_sincos(state: dict, cfg: ViTConfig) -> bool:
    """Whether the position tables hold MAE's fixed sin-cos values (read as learned when only shapes
    were read: the same shapes, for a memory plan)."""
    pairs = [(_ENCODER, cfg.d_model)] + ([(_DECODER, cfg.decoder_d_model)] if _DECODER in state else [])
    return all(
        k in state
        and dim % 4 == 0
        and state[k].shape == (1, cfg.n_patches + 1, dim)
        and not state[k].is_meta
        and torch.allclose(state[k].float(), sincos_2d(cfg.grid, dim), atol=1e-5)
        for k, dim in pairs
    )


def _blocks(ours: str, theirs: str, n: int, optional: bool = False) -> list[Rule]:
    out = []
    for i in range(n):
        a, b = f"{ours}.{i}.", f"{theirs}.{i}."
        for w in ("weight", "bias"):
            out.append(
                rule(
                    f"{a}attn.qkv.{w}",
                    *(f"{b}attention.attention.{p}.{w}" for p in ("query", "key", "value")),
                    optional=optional,
                )
            )
            out += [rule(f"{a}{o}.{w}", f"{b}{t}.{w}", optional=optional) for o, t in _BLOCK]
    return out


def rules(cfg: ViTConfig) -> list[Rule]:
    """Encoder (model.*), and when present the MAE decoder (heads.decoder.*) and a classifier."""
    out = [
        rule("model.cls_token", "vit.embeddings.cls_token"),
        rule("model.norm.weight", "vit.layernorm.weight"),
        rule("model.norm.bias", "vit.layernorm.bias"),
    ]
    out += [
        rule(f"model.patch_embed.{w}", f"vit.embeddings.patch_embeddings.projection.{w}") for w in ("weight", "bias")
    ]
    out += _blocks("model.blocks", "vit.encoder.layer", cfg.n_layer)
    dec = [rule("heads.decoder.mask_token", "decoder.mask_token", optional=True)]
    dec += [
        rule(f"heads.decoder.{o}.{w}", f"decoder.{t}.{w}", optional=True)
        for o, t in (("embed", "decoder_embed"), ("norm", "decoder_norm"), ("pred", "decoder_pred"))
        for w in ("weight", "bias")
    ]
    dec += _blocks("heads.decoder.blocks", "decoder.decoder_encoder.layer", cfg.decoder_n_layer, optional=True)
    if cfg.pos_embed == "learned":
        out.append(rule("model.pos_embed", _ENCODER))
        dec.append(rule("heads.decoder.pos_embed", _DECODER, optional=True))
    return out + dec + [rule(f"heads.classifier.{w}", f"classifier.{w}", optional=True) for w in ("weight", "bias")]


def normalize(state: dict) -> dict:
    """5.x in-memory names and a bare ViTModel's (no 'vit.' prefix) -> the on-disk names."""
    if not any(k.startswith(("vit.", "decoder.", "classifier.")) for k in state):
        state = {f"vit.{k}": v for k, v in state.items()}
    return renamed(state, _MODERN)


def common(cfg: ViTConfig) -> dict:
    return {
        "image_size": cfg.image_size,
        "patch_size": cfg.patch_size,
        "num_channels": cfg.channels,
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff,
        "hidden_act": "gelu",
        "hidden_dropout_prob": cfg.dropout,
        "attention_probs_dropout_prob": cfg.dropout,
        "layer_norm_eps": cfg.layer_norm_eps,
        "qkv_bias": True,
    }


def export(backbone, recipe) -> Export:
    """ViTForImageClassification for a classifier run ([CLS] pooling), ViTMAEForPreTraining for an MAE
    run; sin-cos positions are written out as the fixed tensors transformers keeps."""
    cfg, heads = backbone.cfg, backbone.heads
    if cfg.stem == "conv":
        raise UserError(
            "a ViT with a convolutional stem (model.stem conv) has no transformers class; it stays a "
            "tfcli run (tfcli eval, finetune --from, probe read it)"
        )
    extra = {}
    if cfg.pos_embed == "sincos":
        extra[_ENCODER] = sincos_2d(cfg.grid, cfg.d_model)
    if "classifier.weight" in heads:
        labels = list(backbone.labels) or [str(i) for i in range(heads["classifier.weight"].shape[0])]
        label_maps = {"id2label": dict(enumerate(labels)), "label2id": {n: i for i, n in enumerate(labels)}}
        if getattr(recipe.settings if recipe is not None else None, "pooling", "") == "mean":
            return _dinov2(backbone, recipe, label_maps)
        config = {"architectures": ["ViTForImageClassification"], "model_type": "vit", **common(cfg), **label_maps}
    else:
        if cfg.pos_embed == "sincos":
            extra[_DECODER] = sincos_2d(cfg.grid, cfg.decoder_d_model)
        config = {
            "architectures": ["ViTMAEForPreTraining"],
            "model_type": "vit_mae",
            **common(cfg),
            "decoder_hidden_size": cfg.decoder_d_model,
            "decoder_num_hidden_layers": cfg.decoder_n_layer,
            "decoder_num_attention_heads": cfg.decoder_n_head,
            "decoder_intermediate_size": cfg.decoder_d_ff,
            "mask_ratio": cfg.mask_ratio,
            "norm_pix_loss": cfg.norm_pix_loss,
        }
    return Export(config, extra_tensors=extra, files=_processor(cfg, recipe))


def _processor(cfg: ViTConfig, recipe) -> dict[str, str]:
    """preprocessor_config.json: resize to the model's size, scale to [0, 1], the run's mean and std."""
    images = recipe.settings if recipe is not None and hasattr(recipe.settings, "mean") else None
    mean, std = (list(images.mean), list(images.std)) if images else ([0.5] * 3, [0.5] * 3)
    processor = {
        "image_processor_type": "ViTImageProcessor",
        "do_resize": True,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": mean,
        "image_std": std,
        "resample": 2,
        "size": {"height": cfg.image_size, "width": cfg.image_size},
    }
    return {"preprocessor_config.json": json_text(processor)}


def _dinov2(backbone, recipe, label_maps: dict) -> Export:
    """A mean-pooled classifier as transformers' Dinov2ForImageClassification: its blocks are ViT's
    with a layer scale (written as ones) and its classifier reads [CLS; mean of the patches], so the
    head's weights go on the mean half and zeros on the [CLS] half: the same logits exactly."""
    cfg, heads = backbone.cfg, backbone.heads
    if cfg.d_ff % cfg.d_model:
        raise UserError(
            f"a mean-pooled ViT exports as Dinov2, whose MLP width is a multiple of the width; "
            f"model.d_ff {cfg.d_ff} is not a multiple of model.d_model {cfg.d_model}"
        )
    rules = [
        rule("model.cls_token", "dinov2.embeddings.cls_token"),
        rule("model.norm.weight", "dinov2.layernorm.weight"),
        rule("model.norm.bias", "dinov2.layernorm.bias"),
    ]
    rules += [
        rule(f"model.patch_embed.{w}", f"dinov2.embeddings.patch_embeddings.projection.{w}") for w in ("weight", "bias")
    ]
    for i in range(cfg.n_layer):
        a, b = f"model.blocks.{i}.", f"dinov2.encoder.layer.{i}."
        for w in ("weight", "bias"):
            rules.append(
                rule(f"{a}attn.qkv.{w}", *(f"{b}attention.attention.{p}.{w}" for p in ("query", "key", "value")))
            )
            rules += [
                rule(f"{a}{o}.{w}", f"{b}{t}.{w}")
                for o, t in (
                    ("norm_attn", "norm1"),
                    ("norm_mlp", "norm2"),
                    ("attn.out", "attention.output.dense"),
                    ("mlp.up", "mlp.fc1"),
                    ("mlp.down", "mlp.fc2"),
                )
            ]
    positions = "dinov2.embeddings.position_embeddings"
    extra = {
        f"dinov2.encoder.layer.{i}.layer_scale{j}.lambda1": torch.ones(cfg.d_model)
        for i in range(cfg.n_layer)
        for j in (1, 2)
    }
    if cfg.pos_embed == "learned":
        rules.append(rule("model.pos_embed", positions))
    else:
        extra[positions] = sincos_2d(cfg.grid, cfg.d_model)
    w = heads["classifier.weight"]  # (n, D) on the mean of the patches
    extra["classifier.weight"] = torch.cat([torch.zeros_like(w), w], dim=1)  # (n, 2D): [CLS; mean]
    extra["classifier.bias"] = heads["classifier.bias"]
    config = {
        "architectures": ["Dinov2ForImageClassification"],
        "model_type": "dinov2",
        **common(cfg),
        "mlp_ratio": cfg.d_ff // cfg.d_model,
        "layerscale_value": 1.0,
        "use_swiglu_ffn": False,
        "use_mask_token": False,
        "drop_path_rate": 0.0,
        "apply_layernorm": True,
        **label_maps,
    }
    return Export(config, extra_tensors=extra, files=_processor(cfg, recipe), rules=rules)
