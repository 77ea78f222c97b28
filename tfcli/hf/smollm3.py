"""SmolLM3 <-> transformers' SmolLM3ForCausalLM, as a llama-family switch: the layers `no_rope_layers`
marks 0 use no rotary positions (NoPE), by default every fourth.
"""

from __future__ import annotations

from ..errors import UserError
from ..models.llama import LlamaConfig
from . import llama
from .convert import Export, Rule

ARCHITECTURE = "SmolLM3ForCausalLM"
normalize = llama.normalize


def config_from_hf(raw: dict, state=None) -> LlamaConfig:
    n = raw["num_hidden_layers"]
    every = raw.get("no_rope_layer_interval", 4)
    if not isinstance(every, int) or every < 1:
        raise UserError(f"smollm3: config.json's no_rope_layer_interval must be >= 1, not {every!r}")
    uses_rope = raw.get("no_rope_layers") or [int((i + 1) % every != 0) for i in range(n)]
    if not isinstance(uses_rope, list) or len(uses_rope) != n or any(r not in (0, 1) for r in uses_rope):
        got = f"{len(uses_rope)} entries" if isinstance(uses_rope, list) else repr(uses_rope)
        raise UserError(f"smollm3: config.json's no_rope_layers must hold a 0 or 1 for each of {n} layers ({got})")
    if raw.get("use_sliding_window") and raw.get("sliding_window"):
        raise UserError("smollm3: a sliding window is not supported")
    bias = bool(raw.get("attention_bias", False))
    return LlamaConfig(
        **llama.common_config(raw, tie_default=True),
        qkv_bias=bias,
        out_bias=bias,
        nope_layers=tuple(i for i, rope in enumerate(uses_rope) if not rope),
    )


def config_to_hf(cfg: LlamaConfig) -> dict:
    llama.refuse_switches(cfg, ARCHITECTURE, ("nope_layers",))
    if cfg.qkv_bias != cfg.out_bias or cfg.qk_norm or cfg.sliding_window:
        raise UserError(f"this model's biases, q/k norms or window are not {ARCHITECTURE}'s")
    return {
        **llama.common_to_hf(cfg, ARCHITECTURE),
        "attention_bias": cfg.qkv_bias,
        "mlp_bias": cfg.mlp_bias,
        "no_rope_layers": [int(i not in cfg.nope_layers) for i in range(cfg.n_layer)],
        "use_sliding_window": False,
        "sliding_window": None,
    }


def rules(cfg: LlamaConfig) -> list[Rule]:
    return llama.rules(cfg)


def export(backbone, recipe) -> Export:
    return llama.export(backbone, recipe, config_to_hf)
