"""The registry of architectures tfcli reads natively: one Record (hf/record.py) per transformers
model_type, in the order `tfcli models` and the docs list them. A new architecture is its table module
(or a few lines in a close group's) and one line here; nothing else asks which model_type it is.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import UserError
from . import generic
from .record import Record
from .traits import Decoder, Experts

# fmt: off
HELD_BY_GEMMA = ("activation", "norms", "layer_types", "local_rope_theta", "embed_scale", "attn_scale")
RECORDS: tuple[Record, ...] = (
    Record("gpt2", "GPT-2", "gpt", "gpt2", "GPT2LMHeadModel"),
    Record(
        "llama", "Llama", "llama", "llama", "LlamaForCausalLM", gguf="llama",
        traits=Decoder(keys=("attention_bias", "mlp_bias")),
    ),
    Record(
        "qwen2", "Qwen2", "llama", "llama", "Qwen2ForCausalLM", gguf="qwen2",
        traits=Decoder(fixed=(("qkv_bias", True),), keys=("use_sliding_window",)),
    ),
    Record("mistral", "Mistral", "llama", "llama", "MistralForCausalLM", traits=Decoder(keys=("sliding_window",))),
    Record(
        "qwen3", "Qwen3", "llama", "llama", "Qwen3ForCausalLM", gguf="qwen3",
        traits=Decoder(fixed=(("qk_norm", True),), keys=("attention_bias", "use_sliding_window")),
    ),
    Record(
        "gemma2", "Gemma 2", "llama", "gemma", "Gemma2ForCausalLM", gguf="gemma2",
        traits=Decoder(
            holds=(*HELD_BY_GEMMA, "attn_softcap", "logit_softcap"), keys=("attention_bias", "attn_logit_softcapping")
        ),
    ),
    Record(
        "gemma3_text", "Gemma 3", "llama", "gemma", "Gemma3ForCausalLM", gguf="gemma3",
        traits=Decoder(
            fixed=(("qk_norm", True),),
            holds=HELD_BY_GEMMA,
            keys=("attention_bias", "sliding_window_pattern", "rope_local_base_freq"),
        ),
    ),
    Record("olmo2", "OLMo 2", "llama", "olmo2", "Olmo2ForCausalLM", gguf="olmo2", traits=Decoder()),
    Record("phi3", "Phi-3 / Phi-4", "llama", "phi3", "Phi3ForCausalLM", gguf="phi3", traits=Decoder()),
    Record("smollm3", "SmolLM3", "llama", "smollm3", "SmolLM3ForCausalLM", gguf="smollm3", traits=Decoder()),
    Record("granite", "Granite", "llama", "granite", "GraniteForCausalLM", gguf="granite", traits=Decoder()),
    Record(
        "qwen3_moe", "Qwen3-MoE", "llama", "moe", "Qwen3MoeForCausalLM", gguf="qwen3moe",
        traits=Decoder(
            fixed=(("qk_norm", True),),
            keys=("attention_bias", "use_sliding_window"),
            experts=Experts(qwen_layout=True),
        ),
    ),
    Record(
        "qwen2_moe", "Qwen2-MoE", "llama", "moe", "Qwen2MoeForCausalLM", gguf="qwen2moe",
        traits=Decoder(keys=("qkv_bias", "use_sliding_window"), experts=Experts(qwen_layout=True, shared_expert=True)),
    ),
    Record(
        "mixtral", "Mixtral", "llama", "moe", "MixtralForCausalLM", gguf="llama",
        traits=Decoder(
            keys=("sliding_window",),
            experts=Experts("block_sparse_moe", ("w1", "w3", "w2"), "num_local_experts", renormalises=True),
        ),
    ),
    Record(
        "olmoe", "OLMoE", "llama", "moe", "OlmoeForCausalLM", gguf="olmoe",
        traits=Decoder(
            fixed=(("qk_norm", True), ("qk_norm_whole", True)),
            holds=("qk_norm_whole",),
            keys=("attention_bias", "clip_qkv"),
            experts=Experts(aux_default=0.01),
        ),
    ),
    Record(
        "gpt_oss", "gpt-oss", "llama", "gpt_oss", "GptOssForCausalLM", gguf="gpt-oss",
        traits=Decoder(
            holds=("layer_types", "attn_sinks", "expert_bias", "swiglu_limit", "swiglu_alpha"),
            keys=("attention_bias", "sliding_window"),
            experts=Experts(count_key="num_local_experts", renormalises=True),
        ),
    ),
    Record(
        "deepseek_v3", "DeepSeek-V3", "llama", "deepseek_v3", "DeepseekV3ForCausalLM", gguf="deepseek2",
        traits=Decoder(
            holds=("dense_layers", "attn_scale"),
            keys=("attention_bias",),
            experts=Experts(count_key="n_routed_experts", aux_default=0.0, shared_block="shared_experts"),
        ),
    ),
    Record("bert", "BERT", "bert", "bert"),
    Record("roberta", "RoBERTa", "bert", "roberta"),
    Record("xlm-roberta", "XLM-RoBERTa", "bert", "roberta"),
    Record("modernbert", "ModernBERT", "modernbert", "modernbert"),
    Record("t5", "T5", "t5", "t5", "T5ForConditionalGeneration"),
    Record("vit", "ViT", "vit", "vit"),
    Record("vit_mae", "ViT-MAE", "vit", "vit"),
    Record("llava", "LLaVA", "vlm", "llava", "LlavaForConditionalGeneration", reads_images=True),
    Record("idefics3", "Idefics3", "vlm", "idefics3", "Idefics3ForConditionalGeneration", reads_images=True),
    Record("smolvlm", "SmolVLM", "vlm", "idefics3", "SmolVLMForConditionalGeneration", reads_images=True),
)
# fmt: on
NATIVE = {r.model_type: r for r in RECORDS}
DEFAULT_TABLES = {  # tfcli family -> the record a run built from a recipe (no model_type of its own) exports as
    "gpt": "gpt2",
    "llama": "llama",
    "bert": "bert",
    "modernbert": "modernbert",
    "t5": "t5",
    "vit": "vit",
    "vlm": "llava",
}


def generic_record(model_type: str, decoder: bool) -> Record:
    """Any other architecture transformers ships, through its own modules (the optional extra)."""
    return Record(model_type, model_type, "generic" if decoder else "generic-encoder", "generic")


def record_of(raw: dict, where: Path) -> Record:
    """The record of a transformers config: a native one, else the generic path's for any type
    transformers ships (the optional extra); or one line naming what tfcli reads. A config that names
    code of its own (auto_map) never runs it."""
    model_type = raw.get("model_type")
    if model_type in NATIVE:
        return NATIVE[model_type]
    known = ", ".join(NATIVE)
    try:
        import transformers
    except ImportError:
        raise UserError(
            f"{where}: model_type {model_type!r} has no native family (native: {known}); any other "
            f"architecture transformers ships runs with pip install 'tfcli[transformers]'"
        ) from None
    if model_type in transformers.CONFIG_MAPPING and ("vision_config" in raw or "text_config" in raw):
        native = ", ".join(r.model_type for r in of_family("vlm"))
        raise UserError(
            f"{where}: model_type {model_type!r} is a vision-language (or other multimodal) model with no native "
            f"family (tfcli's: {native}); the generic path reads text models only"
        )
    if model_type in transformers.CONFIG_MAPPING:
        return generic_record(model_type, generic.is_decoder(raw))
    if raw.get("auto_map"):
        raise UserError(
            f"{where}: model_type {model_type!r} asks for remote code (auto_map); tfcli never runs a checkpoint's code"
        )
    raise UserError(
        f"{where}: model_type {model_type!r} is not supported (native: {known}; nor does transformers ship it)"
    )


GENERIC = ("generic", "generic-encoder")  # the generic path's families: any other model_type


def exported_as(family: str, model_type: str | None) -> Record | None:
    """The record a run exports as: the architecture it came from (a llama-family model's
    hf_model_type), else its family's default; the generic path's for its families; None for a family
    that has none."""
    if family in GENERIC:
        return generic_record(model_type or "", family == GENERIC[0])
    if model_type in NATIVE:
        return NATIVE[model_type]
    return NATIVE.get(DEFAULT_TABLES.get(family, ""))


def decoder_record(model_type: str | None) -> Record:
    """A vision-language model's decoder: a llama-family architecture's record, or one line."""
    found = NATIVE.get(model_type or "")
    if found is None or found.family != "llama":
        known = ", ".join(r.model_type for r in RECORDS if r.family == "llama")
        raise UserError(f"a vision-language model's decoder must be a llama-family one ({known}); not {model_type!r}")
    return found


def of_family(family: str) -> tuple[Record, ...]:
    return tuple(r for r in RECORDS if r.family == family)


def gguf_model_types() -> dict[str, str]:
    """llama.cpp's architecture -> the model_type it reads as (the first record naming it: Mixtral is
    written as llama with experts and read back as Llama with experts)."""
    out: dict[str, str] = {}
    for r in RECORDS:
        if r.gguf:
            out.setdefault(r.gguf, r.model_type)
    return out


def gguf_model_type(arch: str, experts: bool = False) -> str:
    """The model_type a llama.cpp architecture reads as: of the records naming it, the one with experts
    where the file has them (llama with experts: Mixtral), else the first."""
    named = [r for r in RECORDS if r.gguf == arch]
    with_experts = [r for r in named if r.traits is not None and (r.traits.experts is not None) == experts]
    return (with_experts or named)[0].model_type


def architecture(model_type: str) -> str:
    """The transformers class a native model_type's causal-LM export writes."""
    return NATIVE[model_type].architecture


def decoder_traits(model_type: str) -> Decoder:
    """How a llama-family architecture differs from Llama's (its record's traits)."""
    return NATIVE[model_type].traits


def same_table(model_type: str) -> tuple[str, ...]:
    """The model_types read by the same table as `model_type` (what an export may be set to instead)."""
    table = NATIVE[model_type].table_module
    return tuple(r.model_type for r in RECORDS if r.table_module == table)


def architectures_markdown() -> str:
    """The docs' table of every native architecture (docs/hooks/architectures.py writes it into the
    README and docs/interop.md; tests/test_records.py checks they agree with this registry)."""
    lines = [
        "| architecture | `model_type` | tfcli family | a generative run exports as | GGUF (llama.cpp) |",
        "|---|---|---|---|---|",
    ]
    for r in RECORDS:
        arch = f"`{r.architecture}`" if r.architecture else "by the run's head"
        lines.append(f"| {r.name} | `{r.model_type}` | {r.family} | {arch} | {r.gguf or '-'} |")
    return "\n".join(lines) + "\n"
