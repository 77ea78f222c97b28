"""Hugging Face ViT-MAE / ViT <-> tfcli ViT + MAEDecoder: config translation and state-dict renaming.

Covers ViTMAEForPreTraining (encoder + decoder; identical outputs given the same `noise`) and
ViTForImageClassification (encoder + linear classifier on the final [CLS]). transformers' separate
q/k/v projections become our fused qkv. Fixed sin-cos position embeddings are recognised on import
(and recomputed, not stored); anything else is loaded as learned positions. Older transformers
checkpoints (`encoder.layer.N.attention.attention.query`, ...) are renamed on the way in.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor, nn

from ..errors import UserError
from ..models.vit import MAEDecoder, ViT, ViTConfig, sincos_2d

LEGACY = [  # transformers 4.x names (also what 5.x writes to disk) -> 5.x module names
    (r"^decoder\.decoder_encoder\.layer\.", "decoder.decoder_layers."), (r"\.encoder\.layer\.", ".layers."),
    (r"\.attention\.attention\.query\.", ".attention.q_proj."),
    (r"\.attention\.attention\.key\.", ".attention.k_proj."), (r"\.attention\.attention\.value\.", ".attention.v_proj."),
    (r"\.attention\.output\.dense\.", ".attention.o_proj."), (r"\.intermediate\.dense\.", ".mlp.fc1."),
    (r"\.output\.dense\.", ".mlp.fc2."),
]
BLOCK = [("norm_attn", "layernorm_before"), ("norm_mlp", "layernorm_after"), ("attn.out", "attention.o_proj"),
         ("mlp.up", "mlp.fc1"), ("mlp.down", "mlp.fc2")]


def config_from_hf(hf: dict, pos_embed: str = "sincos") -> ViTConfig:
    """A ViTMAEConfig or ViTConfig dict -> ViTConfig (decoder fields keep their defaults for ViT)."""
    if hf.get("hidden_act", "gelu") != "gelu" or not hf.get("qkv_bias", True):
        raise UserError("only ViTs with exact GELU and q/k/v biases are supported")
    d = ViTConfig()
    return ViTConfig(
        image_size=hf["image_size"], patch_size=hf["patch_size"], channels=hf.get("num_channels", 3),
        n_layer=hf["num_hidden_layers"], n_head=hf["num_attention_heads"], d_model=hf["hidden_size"],
        d_ff=hf["intermediate_size"], dropout=hf.get("hidden_dropout_prob", 0.0),
        layer_norm_eps=hf.get("layer_norm_eps", 1e-12), pos_embed=pos_embed,
        decoder_d_model=hf.get("decoder_hidden_size", d.decoder_d_model),
        decoder_n_layer=hf.get("decoder_num_hidden_layers", d.decoder_n_layer),
        decoder_n_head=hf.get("decoder_num_attention_heads", d.decoder_n_head),
        decoder_d_ff=hf.get("decoder_intermediate_size", d.decoder_d_ff),
        mask_ratio=hf.get("mask_ratio", d.mask_ratio), norm_pix_loss=hf.get("norm_pix_loss", d.norm_pix_loss))


def config_to_hf(cfg: ViTConfig, mae: bool = True, labels: Optional[list[str]] = None):
    """ViTConfig -> transformers ViTMAEConfig (mae) or ViTConfig (classification)."""
    import transformers

    common = dict(image_size=cfg.image_size, patch_size=cfg.patch_size, num_channels=cfg.channels,
                  num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head, hidden_size=cfg.d_model,
                  intermediate_size=cfg.d_ff, hidden_act="gelu", hidden_dropout_prob=cfg.dropout,
                  attention_probs_dropout_prob=cfg.dropout, layer_norm_eps=cfg.layer_norm_eps, qkv_bias=True)
    if mae:
        return transformers.ViTMAEConfig(
            **common, decoder_hidden_size=cfg.decoder_d_model, decoder_num_hidden_layers=cfg.decoder_n_layer,
            decoder_num_attention_heads=cfg.decoder_n_head, decoder_intermediate_size=cfg.decoder_d_ff,
            mask_ratio=cfg.mask_ratio, norm_pix_loss=cfg.norm_pix_loss)
    labels = labels or ["0", "1"]
    return transformers.ViTConfig(**common, num_labels=len(labels), id2label=dict(enumerate(labels)),
                                  label2id={n: i for i, n in enumerate(labels)})


def _blocks_to_hf(sd: dict[str, Tensor], ours: str, theirs: str, n: int, out: dict) -> None:
    for i in range(n):
        a, b = f"{ours}.{i}.", f"{theirs}.{i}."
        for part in ("weight", "bias"):
            for o, t in BLOCK:
                out[f"{b}{t}.{part}"] = sd[f"{a}{o}.{part}"]
            q, k, v = sd[f"{a}attn.qkv.{part}"].chunk(3, dim=0)
            out[f"{b}attention.q_proj.{part}"], out[f"{b}attention.k_proj.{part}"], out[f"{b}attention.v_proj.{part}"] = q, k, v


def _blocks_from_hf(sd: dict[str, Tensor], theirs: str, ours: str, n: int, out: dict) -> None:
    for i in range(n):
        a, b = f"{theirs}.{i}.", f"{ours}.{i}."
        for part in ("weight", "bias"):
            for o, t in BLOCK:
                out[f"{b}{o}.{part}"] = sd[f"{a}{t}.{part}"]
            out[f"{b}attn.qkv.{part}"] = torch.cat([sd[f"{a}attention.{p}_proj.{part}"] for p in "qkv"], dim=0)


def to_hf(encoder: ViT, decoder: Optional[MAEDecoder] = None, classifier: Optional[nn.Linear] = None) -> dict:
    """tfcli modules -> a transformers state dict (ViTMAEForPreTraining with a decoder,
    ViTForImageClassification with a classifier)."""
    cfg, e = encoder.cfg, encoder.state_dict()
    out = {"vit.embeddings.cls_token": e["cls_token"], "vit.embeddings.position_embeddings": encoder.pos_embed,
           "vit.embeddings.patch_embeddings.projection.weight": e["patch_embed.weight"],
           "vit.embeddings.patch_embeddings.projection.bias": e["patch_embed.bias"],
           "vit.layernorm.weight": e["norm.weight"], "vit.layernorm.bias": e["norm.bias"]}
    _blocks_to_hf(e, "blocks", "vit.layers", cfg.n_layer, out)
    if decoder is not None:
        d = decoder.state_dict()
        out.update({"decoder.mask_token": d["mask_token"], "decoder.decoder_pos_embed": decoder.pos_embed})
        for ours, theirs in (("embed", "decoder_embed"), ("norm", "decoder_norm"), ("pred", "decoder_pred")):
            out[f"decoder.{theirs}.weight"], out[f"decoder.{theirs}.bias"] = d[f"{ours}.weight"], d[f"{ours}.bias"]
        _blocks_to_hf(d, "blocks", "decoder.decoder_layers", cfg.decoder_n_layer, out)
    if classifier is not None:
        out["classifier.weight"], out["classifier.bias"] = classifier.weight, classifier.bias
    return {k: v.detach().clone().contiguous() for k, v in out.items()}


def from_hf(sd: dict[str, Tensor], cfg: ViTConfig) -> tuple[dict, dict, dict]:
    """A transformers state dict -> (encoder, decoder, classifier) state dicts for our modules
    (decoder or classifier empty when the checkpoint has none)."""
    sd = _modern(sd)
    enc = {"cls_token": sd["vit.embeddings.cls_token"],
           "patch_embed.weight": sd["vit.embeddings.patch_embeddings.projection.weight"],
           "patch_embed.bias": sd["vit.embeddings.patch_embeddings.projection.bias"],
           "norm.weight": sd["vit.layernorm.weight"], "norm.bias": sd["vit.layernorm.bias"]}
    if cfg.pos_embed == "learned":
        enc["pos_embed"] = sd["vit.embeddings.position_embeddings"]
    _blocks_from_hf(sd, "vit.layers", "blocks", cfg.n_layer, enc)
    dec = {}
    if "decoder.decoder_embed.weight" in sd:
        dec["mask_token"] = sd["decoder.mask_token"]
        if cfg.pos_embed == "learned":
            dec["pos_embed"] = sd["decoder.decoder_pos_embed"]
        for ours, theirs in (("embed", "decoder_embed"), ("norm", "decoder_norm"), ("pred", "decoder_pred")):
            dec[f"{ours}.weight"], dec[f"{ours}.bias"] = sd[f"decoder.{theirs}.weight"], sd[f"decoder.{theirs}.bias"]
        _blocks_from_hf(sd, "decoder.decoder_layers", "blocks", cfg.decoder_n_layer, dec)
    cls = {k[len("classifier."):]: v for k, v in sd.items() if k.startswith("classifier.")}
    return enc, dec, cls


def _modern(sd: dict[str, Tensor]) -> dict[str, Tensor]:
    """Rename transformers 4.x keys (and a bare ViTModel's, without the 'vit.' prefix) to 5.x."""
    if not any(k.startswith(("vit.", "decoder.", "classifier.")) for k in sd):
        sd = {f"vit.{k}": v for k, v in sd.items()}
    out = {}
    for k, v in sd.items():
        for pattern, repl in LEGACY:
            k = re.sub(pattern, repl, k)
        out[k] = v
    return out


def positions_are_sincos(sd: dict[str, Tensor], hf: dict) -> bool:
    """Whether the checkpoint's position embeddings are MAE's fixed 2-D sin-cos (encoder and decoder)."""
    sd = _modern(sd)
    grid = hf["image_size"] // hf["patch_size"]
    pairs = [("vit.embeddings.position_embeddings", hf["hidden_size"])]
    if "decoder.decoder_pos_embed" in sd:
        pairs.append(("decoder.decoder_pos_embed", hf["decoder_hidden_size"]))
    return all(dim % 4 == 0 and sd[k].shape == (1, grid * grid + 1, dim)
               and torch.allclose(sd[k].float(), sincos_2d(grid, dim), atol=1e-5) for k, dim in pairs)


def read_weights(path: Path) -> dict[str, Tensor]:
    if (path / "model.safetensors").is_file():
        from safetensors.torch import load_file

        return load_file(str(path / "model.safetensors"))
    if (path / "pytorch_model.bin").is_file():
        return torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise UserError(f"{path}: no model.safetensors or pytorch_model.bin")


def read_hf_dir(path: Path, with_heads: bool = False):
    """A local transformers ViT-MAE / ViT directory -> (ViTConfig, encoder state dict)
    (with_heads: also the decoder and classifier state dicts and the raw config)."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise UserError(f"{path}: not a Hugging Face model directory (no config.json); the hub is not "
                        f"reachable from tfcli, download the model elsewhere and pass its directory")
    raw = json.loads((path / "config.json").read_text())
    if raw.get("model_type") not in ("vit_mae", "vit"):
        raise UserError(f"{path}: model_type {raw.get('model_type')!r} is not a ViT or ViT-MAE")
    sd = read_weights(path)
    cfg = config_from_hf(raw, "sincos" if positions_are_sincos(sd, raw) else "learned")
    enc, dec, cls = from_hf(sd, cfg)
    return (cfg, enc, dec, cls, raw) if with_heads else (cfg, enc)


def export(loaded, out: Path) -> str:
    """A loaded tfcli ViT run -> a transformers directory: ViTForImageClassification for an
    image-classify run ([CLS] pooling), ViTMAEForPreTraining for an MAE run."""
    import transformers

    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise UserError(f"{out} exists and is not empty; choose a new --hf directory")
    encoder, heads, cfg = loaded.model, loaded.heads, loaded.model.cfg
    if "classifier.weight" in heads:
        if loaded.recipe.task.pooling != "cls":
            raise UserError("this run classifies mean-pooled patches; transformers' ViTForImageClassification "
                            "uses the [CLS] vector (finetune with --pooling cls to export)")
        classes = Path(loaded.checkpoint).parent.parent / "classes.json"
        n = heads["classifier.weight"].shape[0]
        labels = json.loads(classes.read_text()) if classes.is_file() else [str(i) for i in range(n)]
        head = nn.Linear(cfg.d_model, n)
        head.load_state_dict({"weight": heads["classifier.weight"], "bias": heads["classifier.bias"]})
        hf = transformers.ViTForImageClassification(config_to_hf(cfg, mae=False, labels=labels))
        hf.load_state_dict(to_hf(encoder, classifier=head))
    else:
        decoder = MAEDecoder(cfg)
        decoder.load_state_dict({k[len("decoder."):]: v for k, v in heads.items() if k.startswith("decoder.")})
        hf = transformers.ViTMAEForPreTraining(config_to_hf(cfg, mae=True))
        hf.load_state_dict(to_hf(encoder, decoder=decoder))
    hf.save_pretrained(out)
    return hf.__class__.__name__
