"""Hugging Face interop: read a transformers directory into tfcli weights, write a run back out.

One engine (convert.py) and one table module per family; nothing here is family-specific.
"""

from __future__ import annotations

import json
from pathlib import Path

from torch import Tensor

from .. import adapters
from ..data.special_tokens import CONFIG_FILE, config_text
from ..errors import UserError
from . import (
    bert,
    generic,
    gguf,
    gpt2,
    idefics3,
    llama,
    llava,
    modernbert,
    peft,
    roberta,
    t5,
    vit,
    vlm,
)
from .convert import auto_class, check_writable, read_config, read_state, to_hf, to_tfcli, write_dir

FAMILIES = {
    "gpt": gpt2,
    "llama": llama,
    "bert": bert,
    "modernbert": modernbert,
    "t5": t5,
    "vit": vit,
    "vlm": llava,
}  # tfcli family -> its default table
FAMILIES |= {"generic": generic, "generic-encoder": generic}  # any other architecture transformers ships
# every table module and the tfcli family its model types build: the llama family's switches take several
TABLES = {gpt2: "gpt", **{module: "llama" for module in vlm.DECODER_TABLES}}
TABLES |= {
    bert: "bert",
    roberta: "bert",
    modernbert: "modernbert",
    t5: "t5",
    vit: "vit",
    llava: "vlm",
    idefics3: "vlm",
}


def table_of_type(model_type: str | None, where: Path, remote: bool = False):
    """The table module that reads a transformers model_type: a native family's, else the generic path's
    for any other type transformers ships (the optional extra); or one line naming what tfcli reads.
    `remote`: the config names code of its own (auto_map), which is never run."""
    for module in TABLES:
        if model_type in module.MODEL_TYPES:
            return module
    known = ", ".join(t for m in TABLES for t in m.MODEL_TYPES)
    try:
        import transformers
    except ImportError:
        raise UserError(
            f"{where}: model_type {model_type!r} has no native family (native: {known}); any other "
            f"architecture transformers ships runs with pip install 'tfcli[transformers]'"
        ) from None
    if model_type in transformers.CONFIG_MAPPING:
        return generic
    if remote:
        raise UserError(
            f"{where}: model_type {model_type!r} asks for remote code (auto_map); tfcli never runs a checkpoint's code"
        )
    raise UserError(
        f"{where}: model_type {model_type!r} is not supported (native: {known}; nor does transformers ship it)"
    )


def family_of_config(raw: dict, where: Path) -> str:
    """The tfcli family of a transformers config.json (by its model_type)."""
    module = table_of_type(raw.get("model_type"), where, bool(raw.get("auto_map")))
    if module is generic:
        return "generic" if generic.is_decoder(raw) else "generic-encoder"
    return TABLES[module]


def read_pretrained(path: Path, from_gguf: bool = False, shapes_only: bool = False):
    """A local transformers directory or a GGUF file (`from_gguf`, as engine.model_source found it) ->
    (tfcli model config, state dict with model.* and heads.* names); shapes_only: the state as meta
    tensors, no weight read (a memory plan)."""
    raw, state = gguf.read(Path(path), shapes_only) if from_gguf else (read_config(path), None)
    module = table_of_type(raw.get("model_type"), path, bool(raw.get("auto_map")))
    if getattr(module, "READS_PROCESSOR", False) and not from_gguf:
        raw[vlm.PREPROCESSOR] = vlm.read_processor(path)  # how its images are prepared
    if state is None:  # a table module that reads its directory itself (the generic path: as transformers)
        loader = getattr(module, "load_state", None)
        state = loader(path, raw, shapes_only) if loader else read_state(path, shapes_only)
    state = module.normalize(state)
    try:
        cfg = module.config_from_hf(raw, state)
    except KeyError as e:
        raise UserError(f"{path}/config.json lacks {e.args[0]!r}") from None
    except ValueError as e:
        raise UserError(f"{path}/config.json: {e}") from None
    return cfg, to_tfcli(state, module.rules(cfg))


def tfcli_state(backbone) -> dict[str, Tensor]:
    """A backbone's model and head weights under checkpoint names (model.*, heads.*)."""
    return {
        **{f"model.{k}": v for k, v in backbone.model.state_dict().items()},
        **{f"heads.{k}": v for k, v in backbone.heads.items()},
    }


def family_module(backbone, what: str):
    """The table module of the architecture a backbone exports as (a llama-family model's
    hf_model_type), or one line saying `what` is not available for it."""
    module = FAMILIES.get(backbone.family)
    if module is None:
        raise UserError(f"{what} is not available for {backbone.family!r} models")
    model_type = getattr(backbone.cfg, "hf_model_type", None)
    return table_of_type(model_type, Path(".")) if model_type else module


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
    files = {"tokenizer.json": backbone.tokenizer.tok.to_str()} if backbone.tokenizer is not None else {}
    files = {**files, **spec.files}
    if backbone.tokenizer is not None:  # its special tokens (transformers pads with pad_token) and template
        files[CONFIG_FILE] = tokenizer_config(backbone, json.loads(files.get(CONFIG_FILE, "{}")))
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
    if getattr(backbone.model, "reads_images", False):
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
