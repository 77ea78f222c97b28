"""Hugging Face interop: read a transformers directory into tfcli weights, write a run back out.

One engine (convert.py) and one table module per family; nothing here is family-specific.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

from torch import Tensor

from .. import adapters
from ..data.special_tokens import CONFIG_FILE, config_text
from ..errors import UserError
from ..models import kinds
from . import gguf, peft, registry, reward, vlm
from .convert import auto_class, check_writable, read_config, to_hf, to_tfcli, write_dir
from .record import Record


def record_of_config(raw: dict, where: Path) -> Record:
    """The record of a transformers config.json (by its model_type): hf/registry.py."""
    return registry.record_of(raw, where)


def family_of_config(raw: dict, where: Path) -> str:
    """The tfcli family of a transformers config.json (by its model_type)."""
    return record_of_config(raw, where).family


def read_pretrained(path: Path, raw: dict | None = None, from_gguf: bool = False, shapes_only: bool = False):
    """A local transformers directory or a GGUF file (`from_gguf`, as engine.model_source found it) ->
    (tfcli model config, state dict with model.* and heads.* names). `raw`: its config.json as the
    caller parsed it already (engine.model_source reads it once per command); shapes_only: the state
    as meta tensors, no weight read (a memory plan)."""
    path = Path(path)
    if from_gguf:
        raw, state = gguf.read(path, shapes_only)
    else:
        raw, state = copy.deepcopy(raw) if raw is not None else read_config(path), None
    record = registry.record_of(raw, path)
    if record.reads_images and not from_gguf:
        raw[vlm.PREPROCESSOR] = vlm.read_processor(path)  # how its images are prepared
    if state is None:
        state = record.read_state(path, raw, shapes_only)
    state = record.normalize(state)
    try:
        cfg = record.table.config_from_hf(raw, state)
    except KeyError as e:
        raise UserError(f"{path}/config.json lacks {e.args[0]!r}") from None
    except ValueError as e:
        raise UserError(f"{path}/config.json: {e}") from None
    return cfg, to_tfcli(state, record.table.rules(cfg))


def tfcli_state(backbone) -> dict[str, Tensor]:
    """A backbone's model and head weights under checkpoint names (model.*, heads.*)."""
    return {
        **{f"model.{k}": v for k, v in backbone.model.state_dict().items()},
        **{f"heads.{k}": v for k, v in backbone.heads.items()},
    }


def family_module(backbone, what: str):
    """The table module of the architecture a backbone exports as (a llama-family model's
    hf_model_type, else its family's default), or one line saying `what` is not available for it."""
    record = registry.exported_as(backbone.family, getattr(backbone.cfg, "hf_model_type", None))
    if record is None:
        raise UserError(f"{what} is not available for {backbone.family!r} models")
    return record.table


def merged_export(backbone, recipe, what: str):
    """(the family's Export, the merged model's tensors under transformers' names): what a transformers
    directory and a GGUF file both hold. LoRA / IA3 are folded in, in place."""
    module = family_module(backbone, what)
    adapters.merge(backbone.model)
    spec = module.export(backbone, recipe)
    rules = spec.rules if spec.rules is not None else module.rules(backbone.cfg)
    return spec, to_hf(tfcli_state(backbone), rules)


def export(backbone, recipe, out: Path) -> tuple[str, str]:
    """Write a backbone (model, heads, tokenizer) as a transformers directory; return (its
    architecture, how to load it)."""
    check_writable(out)
    spec, state = merged_export(backbone, recipe, "export to Hugging Face")
    state = {**state, **spec.extra_tensors}
    if spec.convert is not None:
        state = spec.convert(state)
    if reward.is_reward_model(backbone):
        spec, state = reward.as_reward_model(spec, state, backbone, generic=backbone.family == "generic")
    files = {"tokenizer.json": backbone.tokenizer.tok.to_str()} if backbone.tokenizer is not None else {}
    files = {**files, **spec.files}
    if backbone.tokenizer is not None:  # its special tokens (transformers pads with pad_token) and template
        files[CONFIG_FILE] = tokenizer_config(backbone, json.loads(files.get(CONFIG_FILE, "{}")))
        if reward.is_reward_model(backbone):
            files[CONFIG_FILE] = reward.with_pad(files[CONFIG_FILE], spec.config, backbone.tokenizer)
    write_dir(out, spec.config, state, files)
    arch = spec.config["architectures"][0]
    return arch, spec.loads_with or f"transformers.{auto_class(arch)}.from_pretrained({str(out)!r})"


def tokenizer_config(backbone, base: dict) -> str:
    """tokenizer_config.json of an export: the family's own keys (`base`), the tokenizer's special
    tokens, a pad token (its end of text where it names none: transformers' tokenizer cannot pad a
    batch without one) and its chat template (the format the model answers in)."""
    tok = backbone.tokenizer
    base = {"tokenizer_class": "PreTrainedTokenizerFast", **base}
    base.setdefault("model_max_length", getattr(backbone.cfg, "max_seq_len", None) or 512)
    specials = tok.specials
    if specials.pad is None and "pad_token" not in base and tok.eos_id is not None:
        base["pad_token"] = tok.tok.id_to_token(tok.eos_id)
    return config_text(specials, tok.chat_template, base)


def export_gguf(backbone, recipe, out: Path, dtype: str = "f16") -> str:
    """Write a backbone as a GGUF file (llama.cpp, Ollama, LM Studio; tfcli and transformers read it
    back); return its architecture. Only what a GGUF's llama/qwen2/qwen3 architecture or their mixtures (llama with experts, qwen2moe, qwen3moe, olmoe) hold."""
    if reward.is_reward_model(backbone):
        raise UserError(
            "a reward model exports with --hf (AutoModelForSequenceClassification): a GGUF holds no score head"
        )
    spec, state = merged_export(backbone, recipe, "export to GGUF")
    if spec.config.get("model_type") not in gguf.GGUF_ARCH:
        raise UserError(
            f"GGUF export writes {', '.join(gguf.GGUF_ARCH)} models; this is a {spec.config.get('model_type')!r}"
        )
    gguf.write(spec.config, state, backbone.tokenizer, Path(out), dtype)
    return spec.config["model_type"]


def export_peft(backbone, recipe, base: str, out: Path, read_base=None, base_loadable: bool = True) -> str:
    """Write a LoRA run's adapters, unmerged, as a PEFT directory over `base`; return how to load it.
    A base transformers cannot name in adapter_config.json (not `base_loadable`: a GGUF file, a tfcli
    run) is first written as a transformers directory beside the adapters (OUT-base, `read_base()`
    reading it), and the adapters name that: peft's AutoPeftModel then loads the pair by itself."""
    module = family_module(backbone, "export --peft")
    if kinds.reads_images(backbone.model):
        raise UserError(
            "export --peft of a vision-language model is not supported yet (its projector trains whole, beside "
            "the adapters); export --hf writes the merged model"
        )
    auto = {"decoder": "AutoModelForCausalLM", "encoder-decoder": "AutoModelForSeq2SeqLM"}.get(
        backbone.model.kind, "AutoModel"
    )
    if not base_loadable:  # a GGUF or a tfcli run: its transformers export, beside the adapters
        check_writable(Path(f"{out}-base"))
        peft.check(backbone, recipe, module.rules(backbone.cfg), Path(out))
        base_backbone = read_base()
        export(base_backbone, base_backbone.recipe, Path(f"{out}-base"))
        base = str(Path(f"{out}-base").resolve())
    peft.export(backbone, recipe, module.rules(backbone.cfg), base, Path(out))
    load = f"transformers.{auto}.from_pretrained({base!r})"
    return f"peft.PeftModel.from_pretrained({load}, {str(out)!r})  (or peft.AutoPeftModel{auto[len('AutoModel') :]}.from_pretrained({str(out)!r}))"
