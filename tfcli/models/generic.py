"""Any architecture transformers itself ships, through its own modules: the long tail the native families
do not cover. A decoder (family `generic`: *ForCausalLM) or a text encoder (`generic-encoder`: the
bare encoder) built from the config.json it came with, wrapped in the model-kind protocol
(`models/kinds.py`), so that every task whose needs the protocol covers trains it. Needs the optional
extra (`pip install 'tfcli[transformers]'`); never runs a checkpoint's code (no trust_remote_code: only
model types transformers itself has). Native families are always preferred (`hf/interop.py`).

What needs a native family is refused in one line: packed documents, DPO's prompt read once for two
replies, an output layer with a bias, scale or cap the fused losses cannot see, GGUF export.
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass, replace

from torch import Tensor, nn

from ..errors import UserError
from .blocks import dense_flops_per_token
from .pooling import DecoderTraits, TextEncoderTraits

NATIVE_ONLY = "needs a native family (tfcli models lists them)"
# transformers' linear names -> the parts tfcli's adapters target (q, k, v, o, gate, up, down)
LINEAR_PARTS = {
    "q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o", "out_proj": "o", "dense": "o",
    "query": "q", "key": "k", "value": "v", "q_lin": "q", "k_lin": "k", "v_lin": "v", "out_lin": "o",
    "gate_proj": "gate", "up_proj": "up", "down_proj": "down", "fc1": "up", "fc2": "down",
    "c_fc": "up", "c_proj": "down", "lin1": "up", "lin2": "down", "intermediate.dense": "up", "output.dense": "down",
    "attention.output.dense": "o",
}  # fmt: skip
SUFFIXES = sorted(LINEAR_PARTS, key=len, reverse=True)
UNNAMED = "linear"  # the part of a layer's linear with no name above (recipe.AdapterConfig.parts)  # the longest name that fits decides (output.dense)
OUTPUT_CHANGES = ("logit_scale", "logits_scaling", "final_logit_softcapping", "output_multiplier_scale")


def transformers_module():
    try:
        from .nf4 import quiet_torchao

        for module in ("torchao", "torchao.prototype.mx_formats.config"):  # what transformers' quantizers
            quiet_torchao(module)  # import, first, without torchao's notes on CUDA libraries and torch's
    except ImportError:
        pass
    try:
        import transformers
    except ImportError:
        raise UserError(
            "this architecture runs through transformers' own modules: pip install 'tfcli[transformers]'"
        ) from None
    return transformers


@dataclass(frozen=True)
class TransformersConfig:
    """A transformers architecture, as its config.json says (`hf_config`, JSON text); the other fields
    are what tfcli reads of it (filled in from it)."""

    family: str = "generic"
    hf_config: str = "{}"
    n_layer: int = 0
    d_model: int = 0
    vocab_size: int = 0
    max_seq_len: int = 0
    dropout: float = 0.0
    layer_norm_eps: float = 1e-5

    @property
    def raw(self) -> dict:
        return json.loads(self.hf_config)

    def with_layers(self, n: int):
        """Its first n layers (the memory plan probes one and two blocks): every per-layer list of the
        config (layer_types, ...) cut to n too, or repeated where n is more, so transformers' own checks
        of their lengths hold."""
        raw = self.raw
        old = raw[layer_count_key(raw)]
        raw[layer_count_key(raw)] = n
        for key, value in raw.items():
            if isinstance(value, list) and len(value) == old and key != "architectures" and old:
                raw[key] = [value[i % old] for i in range(n)]
        return replace(self, hf_config=json.dumps(raw, sort_keys=True), n_layer=n)

    @property
    def context(self) -> int:
        return self.max_seq_len


@dataclass(frozen=True)
class TransformersEncoderConfig(TransformersConfig):
    family: str = "generic-encoder"


def layer_count_key(raw: dict) -> str:
    found = next((k for k in ("num_hidden_layers", "n_layer", "num_layers", "n_layers") if k in raw), None)
    if found is None:
        raise UserError(f"model_type {raw.get('model_type')!r}: its config.json names no layer count tfcli reads")
    return found


def hf_config_object(raw: dict):
    """transformers' config object for a config.json, refusing what would need a checkpoint's code."""
    transformers = transformers_module()
    model_type = raw.get("model_type")
    if model_type not in transformers.CONFIG_MAPPING:
        raise UserError(
            f"model_type {model_type!r} is not one transformers ships; tfcli never runs a checkpoint's code"
        )
    fields = {k: v for k, v in raw.items() if k not in ("model_type", "transformers_version", "auto_map")}
    return transformers.AutoConfig.for_model(model_type, **fields)


def build_inner(auto, config) -> tuple[nn.Module, str]:
    """(transformers' module of `config`, the attention it runs): PyTorch's fused attention (sdpa) where
    the architecture has it, else its own eager attention (DeBERTa-v2, BLOOM, GPT-Neo have no other)."""
    try:
        return auto.from_config(config, attn_implementation="sdpa"), "sdpa"
    except ValueError as e:
        if "sdpa" not in str(e).lower() and "scaled_dot_product" not in str(e).lower():
            raise
    return auto.from_config(config, attn_implementation="eager"), "eager"


class _Cache:
    """A transformers DynamicCache behind tfcli's cache interface (length, select, rewind)."""

    def __init__(self):
        from transformers import DynamicCache

        self.cache = DynamicCache()

    @property
    def length(self) -> int:
        return self.cache.get_seq_length()

    def select(self, rows: Tensor) -> None:
        self.cache.batch_select_indices(rows)

    def rewind(self, length: int) -> None:
        self.cache.crop(length)


class _Wrapped(nn.Module):
    """What the two generic kinds share: the transformers module (`inner`), its decoder layers (FSDP and
    recomputation take them one by one), and the adapters' names for its linears."""

    def __init__(self, cfg: TransformersConfig, auto: str):
        super().__init__()
        self.cfg = cfg
        transformers = transformers_module()
        config = hf_config_object(cfg.raw)
        if any(config.to_dict().get(k) not in (None, 1.0, 0.0) for k in OUTPUT_CHANGES):
            raise UserError(f"{config.model_type}: its output layer scales or caps the logits, which {NATIVE_ONLY}")
        self.inner, self.attention = build_inner(getattr(transformers, auto), config)
        self._recomputing = False
        forward = inspect.signature(self.inner.base_model.forward).parameters
        self.cache_argument = "cache" if "cache" in forward else "past_key_values"  # transformers 5.x / 4.x

    def describe(self) -> str:
        """The run's first lines say whose module it is and which attention it runs."""
        return f"transformers' {type(self.inner).__name__}, {self.attention} attention"

    def decoder_layers(self) -> list[nn.Module]:
        """Its transformer layers, in order: what FSDP shards one by one and recomputation recomputes
        (models.transformer_blocks asks for them)."""
        return list(self._layers())

    def _layers(self) -> nn.ModuleList:
        names = set(getattr(self.inner, "_no_split_modules", None) or ())
        for m in self.inner.modules():
            if isinstance(m, nn.ModuleList) and len(m) and type(m[0]).__name__ in names:
                return m
        return next(m for m in self.inner.modules() if isinstance(m, nn.ModuleList) and len(m) == self.cfg.n_layer)

    def linear_parts(self, name: str, module: nn.Linear) -> tuple[tuple[str, int], ...] | None:
        """The adapter part a linear of a decoder layer is, by its transformers name; a layer's linear
        with no part name tfcli knows (Falcon's query_key_value) is UNNAMED, which all-linear targets
        (None: not a layer's linear, the output layer among them)."""
        if not name.startswith(self._layer_prefixes()):
            return None
        suffix = next((s for s in SUFFIXES if name.endswith("." + s)), None)
        return ((LINEAR_PARTS[suffix] if suffix else UNNAMED, module.out_features),)

    def _layer_prefixes(self) -> tuple[str, ...]:
        """The module names of its layers ("inner.model.layers.0.", ...), found once."""
        if not getattr(self, "_prefixes", None):
            layers = {id(m) for m in self._layers()}
            self._prefixes = tuple(f"{n}." for n, m in self.named_modules() if id(m) in layers)
        return self._prefixes

    def _recompute(self) -> None:
        """train.activation_checkpointing sets `checkpointing` on each block: transformers' own switch."""
        wanted = self.training and any(getattr(b, "checkpointing", False) for b in self._layers())
        if wanted != self._recomputing:
            if wanted:
                self.inner.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            else:
                self.inner.gradient_checkpointing_disable()
            self._recomputing = wanted

    def flops_per_token(self, seq_len: int, target_len: int = 0) -> float:
        """6 N + attention, N the weights a token meets: not the input table where the output layer is
        a tensor of its own (a lookup multiplies nothing), and of a mixture's experts the k of E it is
        routed to (every expert counted, gpt-oss-20b's MFU read six times too high)."""
        table, head = self.inner.get_input_embeddings(), self.inner.get_output_embeddings()
        lookups = (table,) if table is not None and (head is None or head.weight is not table.weight) else ()
        flops = dense_flops_per_token(self, self.cfg.n_layer, seq_len, self.cfg.d_model, lookups)
        return flops - 6.0 * self._idle_expert_parameters()

    def _idle_expert_parameters(self) -> float:
        """Of each module named `experts` (E experts, a list of modules or stacked parameters), the
        (E - k) / E share a token is not routed to (k: the config's num_experts_per_tok)."""
        k = self.cfg.raw.get("num_experts_per_tok") or 0
        idle = 0.0
        for name, module in self.inner.named_modules():
            if not k or name.rsplit(".", 1)[-1] != "experts":
                continue
            own = list(module.parameters())
            n = (
                len(module)
                if isinstance(module, nn.ModuleList)
                else max((p.shape[0] for p in own if p.dim() >= 2), default=0)
            )
            if n > k:
                idle += sum(p.numel() for p in own) * (n - k) / n
        return idle


class TransformersDecoder(DecoderTraits, _Wrapped):
    """A transformers *ForCausalLM. forward() returns hidden states; logits() applies its output layer."""

    reads_shared_prompt = False  # no blocks.replies_to_one_prompt: DPO and GRPO take a row per reply

    def __init__(self, cfg: TransformersConfig):
        super().__init__(cfg, "AutoModelForCausalLM")
        head = self.inner.get_output_embeddings()
        if getattr(head, "bias", None) is not None:
            raise UserError(f"{self.inner.config.model_type}: its output layer has a bias, which {NATIVE_ONLY}")

    @property
    def lm_head_weight(self) -> Tensor:
        return self.inner.get_output_embeddings().weight

    def new_caches(self, max_len: int | None = None) -> list:
        return [_Cache()]

    def forward(
        self,
        input_ids: Tensor,
        caches: list | None = None,
        all_layers: bool = False,
        doc_ids: Tensor | None = None,
        key_mask: Tensor | None = None,
        shared_prompt: Tensor | None = None,
    ):
        """input_ids (B, T) -> hidden states (B, T, D) after the final norm; caches, every layer's output
        and left padding (key_mask (B, cached + T)) as the native decoders take them."""
        if doc_ids is not None or shared_prompt is not None:
            what = "packed documents (sft.pack)" if doc_ids is not None else "a prompt read once for two replies"
            raise UserError(f"{what} {NATIVE_ONLY}")
        self._recompute()
        start = caches[0].length if caches else 0
        position_ids = None
        if key_mask is not None:
            position_ids = (key_mask.cumsum(1) - 1).clamp(min=0)[:, start:]  # (B, T)
        out = self.inner.base_model(
            input_ids=input_ids,
            attention_mask=key_mask,
            position_ids=position_ids,
            **{self.cache_argument: caches[0].cache if caches else None},
            use_cache=caches is not None,
            output_hidden_states=all_layers,
        )
        return list(out.hidden_states) if all_layers else out.last_hidden_state

    def logits(self, hidden: Tensor) -> Tensor:
        return self.inner.get_output_embeddings()(hidden)


class TransformersEncoder(TextEncoderTraits, _Wrapped):
    """A transformers bare encoder (AutoModel). forward() returns hidden states; pool() is the first
    token's (the encoder's own pooler, if any, is left to a native family)."""

    def __init__(self, cfg: TransformersConfig):
        super().__init__(cfg, "AutoModel")

    @property
    def lm_head_weight(self) -> Tensor:
        return self.inner.get_input_embeddings().weight

    def forward(
        self,
        input_ids: Tensor,
        token_type_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        all_layers: bool = False,
    ):
        self._recompute()
        types = {"token_type_ids": token_type_ids} if getattr(self.inner.config, "type_vocab_size", 0) else {}
        out = self.inner(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=all_layers, **types)
        return list(out.hidden_states) if all_layers else out.last_hidden_state

    def pool(self, hidden: Tensor) -> Tensor:
        return hidden[:, 0]

    def pool_parameters(self) -> list[nn.Parameter]:
        return []
