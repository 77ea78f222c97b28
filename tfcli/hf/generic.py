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
from .convert import Export, Rule, rule


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
        raise UserError(
            f"model_type {raw.get('model_type')!r} is a vision-language (or other multimodal) model with no native "
            f"family (`tfcli models` lists the native ones); the generic path reads text models only"
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


def load_state(path, raw: dict, shapes_only: bool = False) -> dict:
    """The weights under the names of transformers' module, read as transformers reads them
    (from_pretrained): its key renames (GPT-NeoX's embed_out), tied weights and the weight conversions
    transformers 5 makes on load (GLM-4-MoE's and DeepSeek-V3's experts fused into one tensor). A weight
    the module has and the checkpoint lacks is one line, as for every family (a pooler excepted: the
    generic encoder reads the first token's state, not transformers' pooler). shapes_only: the module's
    own shapes, nothing read (a memory plan)."""
    if shapes_only:
        return dict(_meta_model(config_from_hf(raw)).inner.state_dict())
    transformers = transformers_module()
    auto = getattr(transformers, "AutoModelForCausalLM" if is_decoder(raw) else "AutoModel")
    verbosity, bars = transformers.logging.get_verbosity(), transformers.utils.logging.is_progress_bar_enabled()
    transformers.logging.set_verbosity_error()  # its notes on what it initialised: said here, once
    transformers.utils.logging.disable_progress_bar()
    try:
        with torch.random.fork_rng():  # its initialisation before loading leaves the caller's seed alone
            model, info = auto.from_pretrained(
                str(path),
                config=hf_config_object(raw),
                attn_implementation="eager",
                dtype=torch.float32,
                local_files_only=True,
                trust_remote_code=False,
                output_loading_info=True,
            )
    except OSError as e:
        raise UserError(f"{path}: transformers cannot read its weights ({str(e).splitlines()[0][:160]})") from None
    finally:
        transformers.logging.set_verbosity(verbosity)
        if bars:
            transformers.utils.logging.enable_progress_bar()
    missing = sorted(k for k in info["missing_keys"] if ".pooler." not in f".{k}")
    if missing:
        raise UserError(f"not a matching checkpoint: weight {missing[0]!r} is missing")
    if info.get("mismatched_keys"):
        name, theirs, ours = next(iter(info["mismatched_keys"]))
        raise UserError(f"{path}: weight {name!r} is {tuple(theirs)} in the checkpoint, {tuple(ours)} by config.json")
    return dict(model.state_dict())


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
    return Export(raw, rules=rules(backbone.cfg, tied_out=False), convert=_as_saved(backbone.model.inner))


def _as_saved(inner):
    """The module's weights under the names its checkpoints use (transformers' conversions reverted, as
    save_pretrained writes them: experts one tensor each again)."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers 4 converts nothing on load
        return None
    return lambda state: dict(revert_weight_conversion(inner, state))
