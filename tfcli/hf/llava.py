"""LLaVA <-> transformers' LlavaForConditionalGeneration: a CLIP or SigLIP vision tower (or a ViTModel:
a model tfcli composed from an MAE run), a two-layer MLP projector and a llama-family decoder (models/vlm.py), as one weight table and config map.

On disk transformers 5 names the parts `vision_tower.*`, `multi_modal_projector.linear_1/2` and
`language_model.model.*` / `language_model.lm_head` (4.x checkpoints: `vision_tower.vision_model.*`;
5.x in memory: `model.vision_tower.*`, ...: both mapped onto these). The projector reads the tower's hidden state
`vision_feature_layer` with the [CLS] dropped (`vision_feature_select_strategy` "default") or kept
("full"); several feature layers concatenated are not supported.
"""

from __future__ import annotations

from ..errors import UserError
from ..models.vlm import VLMConfig
from . import towers, vlm
from .convert import Export, Rule, renamed, rule

_MODERN = [  # transformers 5.x in-memory names -> the on-disk names
    (r"^model\.language_model\.", "language_model.model."),
    (r"^lm_head\.", "language_model.lm_head."),
    (r"^model\.vision_tower\.", "vision_tower."),
    (r"^vision_tower\.vision_model\.", "vision_tower."),  # the tower as a CLIPVisionModel (4.x checkpoints)
    (r"^model\.multi_modal_projector\.", "multi_modal_projector."),
]
TEXT, HEAD, TOWER = "language_model.model.", "language_model.lm_head.", "vision_tower"


def normalize(state: dict) -> dict:
    return renamed(state, _MODERN)


def config_from_hf(raw: dict, state: dict) -> VLMConfig:
    layer = raw.get("vision_feature_layer", -2)
    if not isinstance(layer, int):
        raise UserError(f"llava: several vision feature layers ({layer}) are not supported; one layer is")
    strategy = raw.get("vision_feature_select_strategy", "default")
    if strategy not in ("default", "full"):
        raise UserError(f"llava: vision_feature_select_strategy {strategy!r} is not supported (default, full)")
    if raw.get("image_grid_pinpoints"):
        raise UserError("llava: only LLaVA's single-image layout is supported (not LLaVA-NeXT's tiles)")
    vision_raw = raw.get("vision_config") or {}
    if towers.is_vit_model(vision_raw.get("model_type")):
        vision = towers.vit_config(vision_raw, state, TOWER)
    else:
        vision = towers.config_from_hf(vision_raw)
    text = vlm.text_config(raw["text_config"], state, TEXT)
    return VLMConfig(
        vision=vision,
        text=text,
        processing=vlm.processing(raw, vision_raw.get("model_type", towers.CLIP)),
        projector="mlp",
        projector_act=_activation(raw.get("projector_hidden_act", "gelu")),
        projector_bias=bool(raw.get("multimodal_projector_bias", True)),
        feature_layer=layer,
        drop_cls=strategy == "default",
        image_token_id=int(raw.get("image_token_id", raw.get("image_token_index", 32000))),
        hf_model_type="llava",
    )


def _activation(name: str):
    acts = {"gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh", "silu": "silu", "relu": "relu"}
    if name not in acts:
        raise UserError(f"llava: projector activation {name!r} is not supported ({', '.join(acts)})")
    return acts[name]


def rules(cfg: VLMConfig) -> list[Rule]:
    out = towers.rules(cfg.vision, "model.vision", TOWER)
    for ours, theirs in (("up", "linear_1"), ("down", "linear_2")):
        out.append(rule(f"model.projector.{ours}.weight", f"multi_modal_projector.{theirs}.weight"))
        if cfg.projector_bias:
            out.append(rule(f"model.projector.{ours}.bias", f"multi_modal_projector.{theirs}.bias"))
    return out + vlm.text_rules(cfg, TEXT, HEAD)


def export(backbone, recipe) -> Export:
    cfg = backbone.cfg
    if cfg.projector != "mlp":
        raise UserError("this vision-language model has Idefics3's projector: set model.hf_model_type idefics3")
    tower = towers.kind_of(cfg.vision)
    text, spec = vlm.export_parts(backbone, recipe)
    acts = {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh", "silu": "silu", "relu": "relu"}
    config = {
        "architectures": ["LlavaForConditionalGeneration"],
        "model_type": "llava",
        "text_config": text,
        "vision_config": towers.config_to_hf(cfg.vision, tower),
        "image_token_id": cfg.image_token_id,
        "image_seq_length": cfg.image_seq_len,
        "projector_hidden_act": acts[cfg.projector_act],
        "multimodal_projector_bias": cfg.projector_bias,
        "vision_feature_layer": cfg.feature_layer,
        "vision_feature_select_strategy": "default" if cfg.drop_cls else "full",
        "tie_word_embeddings": cfg.text.tie_word_embeddings,
    }
    processor_type = towers.TOWERS[tower].processor
    files = {**spec.files, "preprocessor_config.json": vlm.processor_json(cfg, processor_type, {})}
    files["processor_config.json"] = vlm.json_text(
        {
            "processor_class": "LlavaProcessor",
            "image_token": cfg.image_token,
            "patch_size": cfg.vision.patch_size,
            "vision_feature_select_strategy": "default" if cfg.drop_cls else "full",
            "num_additional_image_tokens": int(cfg.vision.cls_token),
        }
    )
    return Export(config, extra_tensors=towers.extra_tensors(cfg.vision, TOWER), files=files)
