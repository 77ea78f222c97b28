"""What sets one llama-family architecture apart from Llama's, as data: a record's `traits`
(hf/registry.py). The llama-family tables (hf/llama.py, gemma.py, moe.py, ...) read these fields where
they once compared model_types, so that an architecture's differences are declared in one place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Experts:
    """How a mixture-of-experts architecture names and configures its experts."""

    block: str = "mlp"  # the feed-forward module under each layer (Mixtral: "block_sparse_moe")
    parts: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # the experts' gate, up, down
    count_key: str = "num_experts"  # config.json's number of experts (Mixtral: num_local_experts)
    aux_default: float = 0.001  # router_aux_loss_coef where config.json names none (transformers')
    renormalises: bool = False  # top-k weights always renormalised (Mixtral); else norm_topk_prob says
    qwen_layout: bool = False  # experts of their own width (moe_intermediate_size), layers left dense
    # (decoder_sparse_step, mlp_only_layers): Qwen's mixtures
    shared_expert: bool = False  # a shared expert beside the routed ones, gated (Qwen2-MoE)
    shared_block: str = "shared_expert"  # the shared expert's module (DeepSeek-V3: "shared_experts")


@dataclass(frozen=True)
class Decoder:
    """A llama-family architecture's differences from Llama's."""

    fixed: tuple[tuple[str, Any], ...] = ()  # LlamaConfig values its class always has: (("qk_norm", True),)
    holds: tuple[str, ...] = ()  # switches beyond Llama's (hf/llama.py: SWITCHES) its class can hold
    # the optional config.json entries its class reads: "attention_bias" (q, k, v and o alike),
    # "qkv_bias" (q, k, v only: Qwen2-MoE), "mlp_bias", "sliding_window" (every layer slides: Mistral,
    # Mixtral), "use_sliding_window" (Qwen's window from max_window_layers on), "clip_qkv" (OLMoE),
    # "attn_logit_softcapping" (Gemma 2), "sliding_window_pattern" and "rope_local_base_freq" (Gemma 3)
    keys: tuple[str, ...] = ()
    experts: Experts | None = None  # a mixture of experts: how it names and configures them

    def value(self, name: str, default: Any = False) -> Any:
        """A LlamaConfig value the architecture fixes, else `default`."""
        return dict(self.fixed).get(name, default)

    def reads(self, key: str) -> bool:
        """Whether its config.json has the optional entry `key`."""
        return key in self.keys
