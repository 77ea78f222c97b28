"""Any other architecture transformers ships <-> the generic families (models/generic.py): the table is
the transformers module's own parameter names under `model.inner.`, read off the model built on the
meta device; config.json is kept whole. A decoder when transformers has a causal LM of the model_type
and the checkpoint's architecture is one, else a bare encoder.
"""

from __future__ import annotations

import json

import torch

from ..errors import UserError
from ..models.generic import (
    TransformersConfig,
    TransformersEncoderConfig,
    hf_config_object,
    layer_count_key,
    transformers_module,
)
from . import idefics3, llava
from .convert import Export, Rule, rule

MODEL_TYPES: tuple[str, ...] = ()  # any model_type transformers ships that no native table reads (interop)


def is_decoder(raw: dict) -> bool:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    archs = raw.get("architectures") or []
    causal = raw.get("model_type") in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    return causal and (not archs or any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs))


def config_from_hf(raw: dict, state=None) -> TransformersConfig:
    transformers_module()
    if raw.get("auto_map") and raw.get("model_type") not in transformers_module().CONFIG_MAPPING:
        raise UserError(
            f"model_type {raw.get('model_type')!r} asks for remote code (auto_map); tfcli never runs a checkpoint's code"
        )
    config = hf_config_object(raw)  # checks the model_type is transformers' own
    if "vision_config" in raw or "text_config" in raw:  # a config of sub-configs: a multimodal model
        native = ", ".join(llava.MODEL_TYPES + idefics3.MODEL_TYPES)
        raise UserError(
            f"model_type {raw.get('model_type')!r} is a vision-language (or other multimodal) model with no native "
            f"family (tfcli's: {native}); the generic path reads text models only"
        )
    kind = TransformersConfig if is_decoder(raw) else TransformersEncoderConfig
    get = lambda *names: next((getattr(config, n) for n in names if getattr(config, n, None)), 0)  # noqa: E731
    return kind(  # transformers' attribute maps give each config the common names (DistilBERT's dim: hidden_size)
        hf_config=json.dumps({k: v for k, v in raw.items() if k != "transformers_version"}, sort_keys=True),
        n_layer=raw[layer_count_key(raw)],
        d_model=get("hidden_size", "d_model", "n_embd"),
        vocab_size=raw["vocab_size"],
        max_seq_len=get("max_position_embeddings", "n_positions") or 2048,
    )


def _meta_model(cfg: TransformersConfig):
    from ..models import build_model

    with torch.device("meta"):
        return build_model(cfg)


def rules(cfg: TransformersConfig, tied_out: bool = True) -> list[Rule]:
    """Every parameter and persistent buffer under its own name. A tied output layer is read from the
    embedding (a checkpoint stores it once); `tied_out=False` leaves it out (what an export writes)."""
    model = _meta_model(cfg)
    inner = model.inner
    out_emb, in_emb = inner.get_output_embeddings(), inner.get_input_embeddings()
    names = {id(p): n for n, p in inner.named_parameters()}
    tied = out_emb is not None and out_emb.weight is in_emb.weight
    out_name = next((n for n, m in inner.named_modules() if m is out_emb), None) if tied else None
    table = []
    for name in inner.state_dict():
        if tied and name == f"{out_name}.weight":
            if tied_out:
                table.append(rule(f"model.inner.{name}", names[id(in_emb.weight)]))
            continue
        table.append(rule(f"model.inner.{name}", name))
    return table


def normalize(state: dict) -> dict:
    return state


def export(backbone, recipe) -> Export:
    """The architecture it came as: config.json as read (the number of labels of a classifier run is
    tfcli's own head, not written: transformers' *ForSequenceClassification heads differ by model)."""
    if "classifier.weight" in backbone.heads:
        raise UserError(
            "export of a classifier on a generic (transformers) model is not built: its head is tfcli's; "
            "export the run's encoder with --head text, or use a native family"
        )
    raw = backbone.cfg.raw
    raw.setdefault("architectures", [type(backbone.model.inner).__name__])
    return Export(raw, rules=rules(backbone.cfg, tied_out=False))
