"""llama.cpp's architectures as hf/gguf.py reads and writes them (the transformers model_type each
is: its record's `gguf`, hf/registry.py): where its tensor names differ from the llama architecture's,
how its stored values differ (llama's q/k rows interleaved for its rotary layout; Gemma's norms stored
as the 1 + w they scale by), and the config keys beyond the ones every architecture shares, both ways.

What llama.cpp's graph fixes rather than reads from a key (Gemma 2's alternating sliding layers, Gemma
3's five sliding layers in six and their rotary base of 10,000, Gemma's query scale) is taken as it
is on reading, and a model that differs is refused on writing in one line: llama.cpp would run it
differently. Written after llama.cpp's convert_hf_to_gguf.py (Gemma2Model, Gemma3Model, Olmo2Model,
Phi3MiniModel) and transformers' GGUF loader.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..errors import UserError

GEMMA_NORMS = {  # Gemma's four norms per block, by llama.cpp's names
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
NOPE_EVERY = 4  # llama.cpp's SmolLM3: every 4th layer without rotary positions
GRANITE_SCALES = (  # llama.cpp's key, gguf's writer for it, transformers' Granite multiplier
    ("attention.scale", "add_attention_scale", "attention_multiplier"),
    ("embedding_scale", "add_embedding_scale", "embedding_multiplier"),
    ("residual_scale", "add_residual_scale", "residual_multiplier"),
    ("logit_scale", "add_logit_scale", "logits_scaling"),
)
# how a SentencePiece file's spaces are read: LlamaTokenizer's prefix space (Llama 2, Mistral), none and
# runs of spaces kept (Gemma's), the prefix space from a normalizer (Phi-3's tokenizer.json)
PREFIX_SPACE, NO_PREFIX_SPACE, PREFIX_NORMALIZER = "prefix-space", "no-prefix-space", "prefix-normalizer"
GEMMA3_LOCAL_THETA = 10000.0  # llama.cpp's rotary base of Gemma 3's sliding layers
LITE_LAYERS = (26, 27)  # llama.cpp's deepseek2 reads no q_lora_rank at these depths (DeepSeek-V2-Lite)
GEMMA_27B_LAYERS = 46  # llama.cpp scales Gemma 2's 27B queries by d / heads, every other Gemma's by head_dim


@dataclass(frozen=True)
class Arch:
    """One llama.cpp architecture: llama's, and the fields and methods where another differs."""

    name: str  # general.architecture
    layer: dict[str, str] = field(default_factory=dict)  # GGUF layer tensor -> transformers module, over gguf.LAYER
    norm_offset: float = 0.0  # stored = transformers' + offset for every *norm.weight (Gemma: 1 + w)
    permuted: bool = False  # q/k rows in llama.cpp's interleaved rotary order (the llama architecture)
    sliding: bool = False  # llama.cpp runs a sliding window for it
    tokenizer: str = PREFIX_SPACE  # a SentencePiece file's spaces (gguf.sentencepiece)
    own_rope_keys: bool = False  # its rope scaling is written by write_extras, not the shared keys (Phi-3)
    own_head_keys: bool = False  # its heads' counts and widths too (DeepSeek's latent attention)

    def config_extras(self, get, raw: dict, factors: dict) -> dict:
        """The config.json entries beyond the shared ones (get: a key of the file's arch; factors:
        Phi-3's rope_factors_long / _short tensors, as lists)."""
        return {}

    def check_writable(self, c: dict) -> None:
        """One line for a model llama.cpp's graph for this architecture would run differently."""
        if c.get("sliding_window") and not self.sliding:
            raise UserError(f"GGUF export: llama.cpp's {self.name} has no sliding window, and this model has one")

    def write_extras(self, writer, c: dict) -> dict:
        """Its keys beyond the shared ones; -> tensors it holds beyond the weights."""
        return {}

    def to_llama_names(self, state: dict, c: dict) -> dict:
        """transformers' tensors (of config c) -> the llama layout hf/gguf.py names (one tensor per
        expert and part)."""
        return state

    def from_llama_names(self, state: dict) -> dict:
        """The inverse of to_llama_names, after reading."""
        return state


@dataclass(frozen=True)
class Gemma(Arch):
    """Gemma 2 / 3: the sliding pattern, query scale and (Gemma 3) local rotary base are fixed by the graph."""

    every: int = 2  # all but every n-th layer slide
    attn_softcap: bool = False  # scores soft-capped (Gemma 2)
    local_rope: bool = False  # the sliding layers turn by their own base (Gemma 3)
    tied_output: bool = False  # the graph reads its output layer from the embedding (Gemma 2)
    wide_queries: int = 0  # a model of this many layers scales queries by d / heads (Gemma 2 27B)

    def query_scalar(self, n_layer: int, d: int, n_head: int, head_dim: int) -> int:
        """The query_pre_attn_scalar llama.cpp's Gemma graphs use (they read no key for it)."""
        return d // n_head if self.wide_queries and n_layer == self.wide_queries else head_dim

    def layer_types(self, n: int) -> list[str]:
        return ["sliding_attention" if (i + 1) % self.every else "full_attention" for i in range(n)]

    def config_extras(self, get, raw: dict, factors: dict) -> dict:
        n = raw["num_hidden_layers"]
        out = {
            "hidden_activation": "gelu_pytorch_tanh",
            "sliding_window": get("attention.sliding_window"),
            "layer_types": self.layer_types(n),
            "query_pre_attn_scalar": self.query_scalar(
                n, raw["hidden_size"], raw["num_attention_heads"], raw["head_dim"]
            ),
            "final_logit_softcapping": get("final_logit_softcapping"),
        }
        if self.attn_softcap:
            out["attn_logit_softcapping"] = get("attn_logit_softcapping")
        if not self.local_rope:
            return out
        full = {"rope_type": "default", "rope_theta": raw["rope_theta"], **raw.pop("rope_scaling", {})}
        full.pop("original_max_position_embeddings", None)
        local = {"rope_type": "default", "rope_theta": GEMMA3_LOCAL_THETA}
        return {**out, "rope_parameters": {"full_attention": full, "sliding_attention": local}}

    def check_writable(self, c: dict) -> None:
        if self.tied_output and not c.get("tie_word_embeddings", True):
            raise UserError(
                f"GGUF export: llama.cpp's {self.name} reads its output layer from the embedding; this model's is "
                "its own"
            )
        super().check_writable(c)
        n = c["num_hidden_layers"]
        if c.get("layer_types") != self.layer_types(n):
            raise UserError(
                f"GGUF export: llama.cpp's {self.name} slides in all but every {self.every}th layer; this model "
                "does not"
            )
        want = self.query_scalar(n, c["hidden_size"], c["num_attention_heads"], c["head_dim"])
        if c.get("query_pre_attn_scalar") != want:
            raise UserError(f"GGUF export: llama.cpp's {self.name} scales queries by {want}^-0.5; this model does not")
        local = (c.get("rope_parameters") or {}).get("sliding_attention", {}).get("rope_theta", GEMMA3_LOCAL_THETA)
        if self.local_rope and local != GEMMA3_LOCAL_THETA:
            raise UserError(
                f"GGUF export: llama.cpp's {self.name} turns its sliding layers by 10000, this model by {local}"
            )

    def write_extras(self, writer, c: dict) -> dict:
        writer.add_sliding_window(int(c["sliding_window"] or 0))
        if c.get("final_logit_softcapping"):
            writer.add_final_logit_softcapping(float(c["final_logit_softcapping"]))
        if self.attn_softcap and c.get("attn_logit_softcapping"):
            writer.add_attn_logit_softcapping(float(c["attn_logit_softcapping"]))
        return {}


@dataclass(frozen=True)
class Granite(Arch):
    """Granite: its four multipliers as keys of their own."""

    def config_extras(self, get, raw: dict, factors: dict) -> dict:
        return {theirs: get(key) for key, _, theirs in GRANITE_SCALES if get(key) is not None}

    def write_extras(self, writer, c: dict) -> dict:
        for _, write, theirs in GRANITE_SCALES:
            if c.get(theirs) is not None:
                getattr(writer, write)(float(c[theirs]))
        return {}


@dataclass(frozen=True)
class SmolLM3(Arch):
    """SmolLM3: llama.cpp leaves rotary positions out of every NOPE_EVERY-th layer, reading no key."""

    def config_extras(self, get, raw: dict, factors: dict) -> dict:
        return {"no_rope_layers": _smollm3_ropes(raw["num_hidden_layers"])}

    def check_writable(self, c: dict) -> None:
        if c.get("no_rope_layers") != _smollm3_ropes(c["num_hidden_layers"]):
            raise UserError(
                f"GGUF export: llama.cpp's smollm3 leaves rotary positions out of every {NOPE_EVERY}th layer; "
                "this model's no_rope_layers differ"
            )
        super().check_writable(c)


@dataclass(frozen=True)
class OLMoE(Arch):
    """OLMoE: llama.cpp norms the keys over as many heads as the queries."""

    def check_writable(self, c: dict) -> None:
        if c.get("num_key_value_heads", c["num_attention_heads"]) != c["num_attention_heads"]:
            raise UserError(
                "GGUF export: llama.cpp's olmoe norms keys over as many heads as queries; this model groups its "
                f"key-value heads ({c['num_key_value_heads']} for {c['num_attention_heads']})"
            )
        super().check_writable(c)


@dataclass(frozen=True)
class Phi3(Arch):
    """Phi-3 / Phi-4: partial rotary, an optional sliding window, LongRoPE's factors as tensors."""

    def config_extras(self, get, raw: dict, factors: dict) -> dict:
        out = {
            "partial_rotary_factor": get("rope.dimension_count", raw["head_dim"]) / raw["head_dim"],
            "sliding_window": get("attention.sliding_window") or None,
            "original_max_position_embeddings": get("rope.scaling.original_context_length")
            or raw["max_position_embeddings"],
        }
        if factors:
            out["rope_scaling"] = {"rope_type": "longrope", **factors}
        return out

    def write_extras(self, writer, c: dict) -> dict:
        import numpy as np

        writer.add_sliding_window(int(c.get("sliding_window") or 0))  # 0: none (Phi-4)
        original = c.get("original_max_position_embeddings") or c["max_position_embeddings"]
        writer.add_rope_scaling_orig_ctx_len(int(original))
        scaling = c.get("rope_scaling") or {}
        if not scaling:
            return {}
        if scaling.get("rope_type") != "longrope":
            raise UserError(
                f"GGUF export: Phi-3's rope scaling {scaling.get('rope_type')!r} has no GGUF form tfcli writes"
            )
        scale = c["max_position_embeddings"] / original
        writer.add_rope_scaling_attn_factors(
            scaling.get("attention_factor")
            or (math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
        )
        return {
            f"rope_factors_{kind}.weight": np.asarray(scaling[f"{kind}_factor"], dtype=np.float32)
            for kind in ("long", "short")
        }


@dataclass(frozen=True)
class GptOss(Arch):
    """gpt-oss: sliding and full layers alternating from the first (the graph's pattern, as Gemma 2's),
    attention sinks, biased router and experts; llama.cpp's graph fixes the clamped SwiGLU's alpha and
    limit. transformers' interleaved (E, D, 2F) gate_up_proj is llama.cpp's ffn_gate_exps and
    ffn_up_exps, (E, F, D) each, as its convert_hf_to_gguf.py splits it."""

    ALPHA, LIMIT = 1.702, 7.0

    def config_extras(self, get, raw: dict, factors: dict) -> dict:
        n = raw["num_hidden_layers"]
        out = {
            "sliding_window": get("attention.sliding_window"),
            "layer_types": ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)],
            "swiglu_alpha": self.ALPHA,
            "swiglu_limit": self.LIMIT,
        }
        if raw.get("rope_scaling", {}).get("rope_type") == "yarn":  # transformers' gpt-oss: no truncation
            out["rope_scaling"] = {**raw["rope_scaling"], "truncate": False}
        return out

    def check_writable(self, c: dict) -> None:
        n = c["num_hidden_layers"]
        if c.get("layer_types") != ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]:
            raise UserError(
                f"GGUF export: llama.cpp's {self.name} slides in every other layer from the first; this model does not"
            )
        if (c.get("swiglu_alpha"), c.get("swiglu_limit")) != (self.ALPHA, self.LIMIT):
            raise UserError(
                f"GGUF export: llama.cpp's {self.name} gates experts with alpha {self.ALPHA} and limit {self.LIMIT}; "
                f"this model's are {c.get('swiglu_alpha')} and {c.get('swiglu_limit')}"
            )
        if (c.get("rope_scaling") or {}).get("rope_type") not in (None, "yarn"):
            raise UserError(f"GGUF export: llama.cpp's {self.name} reads yarn rope scaling or none")

    def write_extras(self, writer, c: dict) -> dict:
        writer.add_sliding_window(int(c["sliding_window"] or 0))
        writer.add_expert_feed_forward_length(int(c["intermediate_size"]))
        return {}

    def to_llama_names(self, state: dict, c: dict) -> dict:
        out = {}
        for name, t in state.items():
            stem, _, leaf = name.rpartition(".")
            if leaf == "sinks":
                out[f"{name}.weight"] = t
            elif stem.endswith("mlp.router"):
                out[f"{stem.removesuffix('router')}gate.{leaf}"] = t
            elif leaf in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"):
                kind = "bias" if leaf.endswith("_bias") else "weight"
                parts = ("gate_proj", "up_proj") if leaf.startswith("gate_up") else ("down_proj",)
                for j, expert in enumerate(t):  # (D, 2F) or (2F,): gate and up interleaved
                    for i, part in enumerate(parts):
                        piece = expert[..., i :: len(parts)]
                        out[f"{stem}.{j}.{part}.{kind}"] = piece.t() if kind == "weight" else piece
            else:
                out[name] = t
        return out

    def from_llama_names(self, state: dict) -> dict:
        import torch

        out, experts = {}, {}
        for name, t in state.items():
            stem, _, rest = name.partition(".experts.")
            if rest:
                j, part, kind = rest.split(".")
                experts.setdefault((stem, part, kind), {})[int(j)] = t
            elif name.endswith(".self_attn.sinks.weight"):
                out[name.removesuffix(".weight")] = t
            elif ".mlp.gate." in name:
                out[name.replace(".mlp.gate.", ".mlp.router.")] = t
            else:
                out[name] = t
        for (stem, part, kind), by_j in experts.items():
            stacked = torch.stack([by_j[j] for j in range(len(by_j))])  # (E, out, in) or (E, out)
            experts[(stem, part, kind)] = stacked.transpose(1, 2) if kind == "weight" else stacked
        for stem, kind in {(s, k) for s, _, k in experts}:
            suffix = "" if kind == "weight" else "_bias"
            gate, up = experts[(stem, "gate_proj", kind)], experts[(stem, "up_proj", kind)]
            out[f"{stem}.experts.gate_up_proj{suffix}"] = torch.stack((gate, up), dim=-1).flatten(-2)
            out[f"{stem}.experts.down_proj{suffix}"] = experts[(stem, "down_proj", kind)]
        return out


@dataclass(frozen=True)
class DeepSeek2(Arch):
    """DeepSeek-V2/V3 (llama.cpp's deepseek2): latent attention written as llama.cpp's absorbed form
    (one key-value head of kv_lora_rank + rope width; kv_b_proj split into per-head attn_k_b,
    transposed, and attn_v_b, as its convert_hf_to_gguf.py does), the sigmoid router's settings as
    keys, its correction bias as exp_probs_b. llama.cpp turns the rotary pairs interleaved (DeepSeek's
    own layout)."""

    def config_extras(self, get, raw: dict, factors: dict) -> dict:
        rope, q_rank = get("rope.dimension_count"), get("attention.q_lora_rank")
        out = {
            "num_key_value_heads": raw["num_attention_heads"],
            "kv_lora_rank": get("attention.kv_lora_rank"),
            "q_lora_rank": q_rank or None,
            "qk_rope_head_dim": rope,
            "qk_nope_head_dim": get("attention.key_length_mla") - rope,
            "v_head_dim": get("attention.value_length_mla"),
            "head_dim": rope,
            "rope_interleave": True,
            "first_k_dense_replace": get("leading_dense_block_count", 0),
            "moe_intermediate_size": get("expert_feed_forward_length"),
            "n_shared_experts": get("expert_shared_count", 0),
            "routed_scaling_factor": get("expert_weights_scale", 1.0),
            "norm_topk_prob": bool(get("expert_weights_norm", False)),
            "n_group": get("expert_group_count", 1),
            "topk_group": get("expert_group_used_count", 1),
        }
        log_mul = get("rope.scaling.yarn_log_multiplier")
        if log_mul and raw.get("rope_scaling"):
            out["rope_scaling"] = {**raw["rope_scaling"], "mscale": log_mul / 0.1, "mscale_all_dim": log_mul / 0.1}
        return out

    def check_writable(self, c: dict) -> None:
        if not c.get("rope_interleave", True):
            raise UserError(f"GGUF export: llama.cpp's {self.name} turns interleaved rotary pairs; this model halves")
        lite = c["num_hidden_layers"] in LITE_LAYERS
        if bool(c.get("q_lora_rank")) == lite:
            raise UserError(
                f"GGUF export: llama.cpp's {self.name} gives queries a low-rank bottleneck (q_lora_rank) by its "
                f"layer count (none at {' or '.join(map(str, LITE_LAYERS))}, DeepSeek-V2-Lite's); this model "
                f"{'has one' if lite else 'has none'} at {c['num_hidden_layers']} layers"
            )
        super().check_writable(c)

    def write_extras(self, writer, c: dict) -> dict:
        rank, rope = c["kv_lora_rank"], c["qk_rope_head_dim"]
        writer.add_head_count_kv(1)
        writer.add_key_length(rank + rope)
        writer.add_value_length(rank)
        writer.add_key_length_mla(c["qk_nope_head_dim"] + rope)
        writer.add_value_length_mla(c["v_head_dim"])
        writer.add_rope_dimension_count(rope)
        writer.add_kv_lora_rank(rank)
        if c.get("q_lora_rank"):
            writer.add_q_lora_rank(c["q_lora_rank"])
        writer.add_leading_dense_block_count(c.get("first_k_dense_replace") or 0)
        writer.add_expert_shared_count(c.get("n_shared_experts") or 0)
        writer.add_expert_weights_scale(float(c.get("routed_scaling_factor", 1.0)))
        writer.add_expert_weights_norm(bool(c.get("norm_topk_prob")))
        from gguf import ExpertGatingFuncType

        writer.add_expert_gating_func(ExpertGatingFuncType.SIGMOID)
        writer.add_expert_group_count(int(c.get("n_group") or 1))
        writer.add_expert_group_used_count(int(c.get("topk_group") or 1))
        scaling = c.get("rope_scaling") or {}
        if scaling.get("mscale_all_dim"):
            writer.add_rope_scaling_yarn_log_mul(0.1 * scaling["mscale_all_dim"])
        return {}

    def to_llama_names(self, state: dict, c: dict) -> dict:
        out = {}
        for name, t in state.items():
            if name.endswith("mlp.gate.e_score_correction_bias"):
                out[name.replace("gate.e_score_correction_bias", "exp_probs.bias")] = t
            elif name.endswith("self_attn.kv_b_proj.weight"):
                stem, nope = name.removesuffix("kv_b_proj.weight"), c["qk_nope_head_dim"]
                kv = t.view(c["num_attention_heads"], -1, t.shape[-1])  # (heads, nope + v, rank)
                out[f"{stem}k_b_proj.weight"] = kv[:, :nope].transpose(1, 2).contiguous()  # (heads, rank, nope)
                out[f"{stem}v_b_proj.weight"] = kv[:, nope:].contiguous()  # (heads, v, rank)
            else:
                out[name] = t
        return out

    def from_llama_names(self, state: dict) -> dict:
        import torch

        out = {}
        for name, t in state.items():
            if name.endswith("mlp.exp_probs.bias"):
                out[name.replace("exp_probs.bias", "gate.e_score_correction_bias")] = t
            elif name.endswith("self_attn.k_b_proj.weight"):
                stem = name.removesuffix("k_b_proj.weight")
                v = state[f"{stem}v_b_proj.weight"]
                kv = torch.cat((t.transpose(1, 2), v), dim=1)  # (heads, nope + v, rank)
                out[f"{stem}kv_b_proj.weight"] = kv.reshape(-1, kv.shape[-1])
            elif not name.endswith("self_attn.v_b_proj.weight"):
                out[name] = t
        return out


def _smollm3_ropes(n: int) -> list[int]:
    """transformers' no_rope_layers (1: the layer turns) as llama.cpp's SmolLM3 fixes them."""
    return [int((i + 1) % NOPE_EVERY != 0) for i in range(n)]


OLMO2_NORMS = {"post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
PHI3_FUSED = {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
ARCHS = {
    a.name: a
    for a in (
        Arch("llama", permuted=True),
        Arch("qwen2"),
        Arch("qwen3"),
        Arch("qwen2moe"),
        Arch("qwen3moe"),
        OLMoE("olmoe"),
        Gemma(
            "gemma2",
            GEMMA_NORMS,
            1.0,
            sliding=True,
            tokenizer=NO_PREFIX_SPACE,
            attn_softcap=True,
            tied_output=True,
            wide_queries=GEMMA_27B_LAYERS,
        ),
        Gemma("gemma3", GEMMA_NORMS, 1.0, sliding=True, tokenizer=NO_PREFIX_SPACE, every=6, local_rope=True),
        Arch("olmo2", OLMO2_NORMS),
        Phi3("phi3", PHI3_FUSED, sliding=True, tokenizer=PREFIX_NORMALIZER, own_rope_keys=True),
        Granite("granite", permuted=True),
        SmolLM3("smollm3", permuted=True),
        DeepSeek2(
            "deepseek2",
            {
                "attn_q_a": "self_attn.q_a_proj",
                "attn_q_a_norm": "self_attn.q_a_layernorm",
                "attn_q_b": "self_attn.q_b_proj",
                "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
                "attn_kv_a_norm": "self_attn.kv_a_layernorm",
                "attn_k_b": "self_attn.k_b_proj",
                "attn_v_b": "self_attn.v_b_proj",
                "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
                "ffn_up_shexp": "mlp.shared_experts.up_proj",
                "ffn_down_shexp": "mlp.shared_experts.down_proj",
                "exp_probs_b": "mlp.exp_probs",
            },
            own_head_keys=True,
        ),
        GptOss(
            "gpt-oss",
            {"post_attention_norm": "post_attention_layernorm", "attn_sinks": "self_attn.sinks"},
            sliding=True,
        ),
    )
}


def rope_dimensions(c: dict) -> int:
    """The rotated width of each head (Phi's partial rotary)."""
    return int(c["head_dim"] * (c.get("partial_rotary_factor") or 1.0))
