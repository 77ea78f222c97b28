"""Idefics3 / SmolVLM <-> transformers' Idefics3ForConditionalGeneration and SmolVLMForConditionalGeneration
(the same architecture under two names: SmolVLM-256M/500M ship as idefics3, SmolVLM2 as smolvlm): a SigLIP vision tower read
whole (its post-layernorm too), a pixel-shuffle projector (`connector.modality_projection.proj`, no
bias) and a llama-family decoder (models/vlm.py), as one weight table and config map.

The tower takes fixed-size frames: the processor (data/image_processor.py, `longest_edge`) cuts an
image into tiles of the tower's size and adds the whole image at that size, so every frame fills the
tower and no patch is padding.
"""

from __future__ import annotations

from ..errors import UserError
from ..models.vlm import VLMConfig
from . import towers, vlm
from .convert import Export, Rule, rule

NAMES = {  # model_type -> (architecture, the tower's model_type, the processor's class)
    "idefics3": ("Idefics3ForConditionalGeneration", "idefics3_vision", "Idefics3"),
    "smolvlm": ("SmolVLMForConditionalGeneration", "smolvlm_vision", "SmolVLM"),
}
TEXT, HEAD, TOWER = "model.text_model.", "lm_head.", "model.vision_model"


def normalize(state: dict) -> dict:
    return state


def config_from_hf(raw: dict, state: dict) -> VLMConfig:
    vision_raw = {**(raw.get("vision_config") or {}), "model_type": towers.IDEFICS3}
    return VLMConfig(
        vision=towers.config_from_hf(vision_raw),
        text=vlm.text_config(raw["text_config"], state, TEXT),
        processing=vlm.processing({**raw, "vision_config": vision_raw}, towers.IDEFICS3, split_default=True),
        projector="shuffle",
        scale_factor=int(raw.get("scale_factor", 2)),
        feature_layer=-1,
        drop_cls=False,
        vision_norm=True,
        image_token_id=int(raw.get("image_token_id", 128257)),
        hf_model_type=raw["model_type"],
    )


def rules(cfg: VLMConfig) -> list[Rule]:
    out = towers.rules(cfg.vision, "model.vision", TOWER)
    out.append(rule("model.projector.proj.weight", "model.connector.modality_projection.proj.weight"))
    return out + vlm.text_rules(cfg, TEXT, HEAD)


def export(backbone, recipe) -> Export:
    cfg = backbone.cfg
    if cfg.projector != "shuffle" or towers.kind_of(cfg.vision) != towers.SIGLIP or not cfg.vision_norm:
        raise UserError(
            "Idefics3 holds a SigLIP tower read whole through a pixel-shuffle projector; this model is not one "
            "(set model.hf_model_type llava)"
        )
    if cfg.feature_layer not in (-1, cfg.vision.n_layer):
        raise UserError(
            f"Idefics3 reads the tower's last layer; this model reads model.feature_layer {cfg.feature_layer}"
        )
    text, spec = vlm.export_parts(backbone, recipe)
    model_type = cfg.hf_model_type if cfg.hf_model_type in NAMES else "idefics3"
    architecture, tower, processor = NAMES[model_type]
    config = {
        "architectures": [architecture],
        "model_type": model_type,
        "text_config": text,
        "vision_config": towers.config_to_hf(cfg.vision, tower),
        "image_token_id": cfg.image_token_id,
        "scale_factor": cfg.scale_factor,
        "tie_word_embeddings": cfg.text.tie_word_embeddings,
    }
    files = {**spec.files, "preprocessor_config.json": vlm.processor_json(cfg, f"{processor}ImageProcessor", {})}
    files["processor_config.json"] = vlm.json_text(
        {"processor_class": f"{processor}Processor", "image_seq_len": cfg.image_seq_len}
    )
    return Export(config, files=files)
