"""Llama-shaped decoder (Llama 2/3, Qwen2/2.5/3, Mistral, SmolLM 1-3, TinyLlama, Gemma 2/3, Phi-3/4,
OLMo 2, Granite): RMSNorm, a gated MLP, rotary positions, grouped-query attention, tied or untied LM
head; and the switches by which these architectures differ from Llama, each off by default: qkv (and
output) biases, q/k norms (per head or over the projection), norms after attention and the MLP as well
as or instead of before, a sliding window in every or some layers (with its own rotary base), layers
without rotary positions, partial rotary, soft-capped scores and logits, and the multipliers of the
embedding, the residual branches, the attention scores and the logits. Built from the shared parts
only.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import ClassVar, Literal

import torch
from torch import Tensor, nn

from .blocks import (
    MLP,
    Attention,
    Block,
    KVCache,
    TiedTable,
    check_config,
    decoder_positions,
    dense_flops_per_token,
    init_normal_,
    make_norm,
    through_blocks,
)
from .latent_attention import LatentAttention
from .moe import Glu, MoE, Routing, moe_layers
from .pooling import DecoderTraits
from .rotary import RopeScaling, Rotary, check_rope

# The architecture switches: Llama's behaviour by default, set by the architecture a checkpoint comes
# from (hf/registry.py). A recipe names one only to change it, so a new switch touches no recipe
# (tests/test_recipe.py); a run's config.yaml records every value.
SWITCHES = (
    "qkv_bias", "out_bias", "mlp_bias", "qk_norm", "sliding_window", "activation", "norms", "qk_norm_whole",
    "layer_types", "local_rope_theta", "nope_layers", "partial_rotary", "embed_scale", "residual_scale",
    "attn_scale", "logit_scale", "attn_softcap", "logit_softcap", "n_experts", "experts_per_token",
    "expert_d_ff", "norm_topk", "shared_expert_d_ff", "sparse_step", "dense_layers", "router_aux_coef",
    "router_z_coef", "attn_sinks", "expert_bias", "swiglu_limit", "swiglu_alpha", "kv_lora_rank",
    "q_lora_rank", "rope_head_dim", "v_head_dim", "rope_interleave", "router_score", "expert_groups",
    "expert_groups_used", "routed_scale", "shared_expert_gate",
)  # fmt: skip


@dataclass(frozen=True)
class LlamaConfig:
    """Shape of a llama-family decoder. vocab_size 0: from the tokenizer; n_kv_head 0: n_head (no
    grouping); head_dim 0: d_model // n_head."""

    SWITCHES: ClassVar[tuple[str, ...]] = SWITCHES

    family: str = "llama"
    n_layer: int = 4
    n_head: int = 4
    n_kv_head: int = 0
    head_dim: int = 0
    rope: RopeScaling = field(default_factory=RopeScaling)  # rotary positions: theta and scaling
    d_model: int = 256
    d_ff: int = 0  # 0 -> SwiGLU's 8/3 * d_model, rounded up to a multiple of 64
    max_seq_len: int = 256  # the context (max_position_embeddings)
    vocab_size: int = 0
    dropout: float = 0.0
    layer_norm_eps: float = 1e-5  # RMSNorm's eps
    tie_word_embeddings: bool = True
    qkv_bias: bool = False  # Qwen2: biases on q, k, v
    out_bias: bool = False  # Llama's attention_bias: on the output projection too
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm of each query and key head
    sliding_window: int = 0  # Mistral: a token attends to the last N positions (0: all)
    hf_model_type: str = "llama"  # the Hugging Face architecture it came from / exports as
    activation: Literal["silu", "gelu_tanh"] = "silu"  # the MLP's gate (Gemma: GeGLU with tanh-GELU)
    norms: Literal["pre", "post", "both"] = "pre"  # before each branch (Llama), after it (OLMo 2), both (Gemma)
    qk_norm_whole: bool = False  # OLMo 2: the q/k norms over the whole projection, not per head
    layer_types: tuple[str, ...] = ()  # per layer "sliding" or "full" (Gemma); (): every layer slides when
    # sliding_window is set
    local_rope_theta: float = 0.0  # Gemma 3: the sliding layers' rotary base (0: the rope's)
    nope_layers: tuple[int, ...] = ()  # SmolLM3: the layers without rotary positions
    partial_rotary: float = 1.0  # Phi: the fraction of each head that is rotated
    embed_scale: float = 1.0  # the embedding's multiplier (Gemma: sqrt(d_model); Granite)
    residual_scale: float = 1.0  # Granite: each branch's multiplier before the residual sum
    attn_scale: float = 0.0  # the scores' multiplier (0: 1/sqrt(head_dim); Gemma's query_pre_attn_scalar; Granite)
    logit_scale: float = 1.0  # Granite: the logits' multiplier (1 / logits_scaling)
    attn_softcap: float = 0.0  # Gemma 2: scores capped to cap * tanh(score / cap) (0: none)
    logit_softcap: float = 0.0  # Gemma 2: the same for the logits
    n_experts: int = 0  # a mixture of experts in place of the MLP (models/moe.py); 0: a dense MLP everywhere
    experts_per_token: int = 2  # the router's top k
    expert_d_ff: int = 0  # each expert's inner width (0: d_ff)
    norm_topk: bool = False  # the top-k weights renormalised to sum to one (Mixtral, Qwen3-MoE)
    shared_expert_d_ff: int = 0  # Qwen2-MoE: a gated shared expert every token passes through (0: none)
    sparse_step: int = 1  # every sparse_step-th layer has experts (Qwen-MoE's decoder_sparse_step)
    dense_layers: tuple[int, ...] = ()  # layers that keep a dense MLP (Qwen-MoE's mlp_only_layers)
    router_aux_coef: float = 0.0  # the load-balancing loss's weight in training (transformers' router_aux_loss_coef)
    router_z_coef: float = 0.0  # the router z-loss's weight (ST-MoE; 0: none)
    attn_sinks: bool = False  # gpt-oss: a learned logit per head in every softmax, attending to nothing
    expert_bias: bool = False  # gpt-oss: biases on the router and on each expert's projections
    swiglu_limit: float = 0.0  # gpt-oss: experts gated by (up + 1) * g * sigmoid(alpha g), g and up
    swiglu_alpha: float = 1.702  # clamped at this limit (0: the plain gated activation)
    kv_lora_rank: int = 0  # DeepSeek-V3: multi-head latent attention from a latent of this width
    # (models/latent_attention.py; 0: grouped-query attention); head_dim is then a query's and key's
    # width, rope_head_dim of it rotary (the last part), v_head_dim a value's (0: head_dim)
    q_lora_rank: int = 0  # the queries' own low-rank bottleneck (0: none)
    rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False  # the rotary dimensions stored in interleaved pairs (DeepSeek's)
    router_score: Literal["softmax", "sigmoid"] = "softmax"  # sigmoid: DeepSeek-V3's router (models/moe.py)
    expert_groups: int = 1  # DeepSeek-V3: experts chosen among the best expert_groups_used of these groups
    expert_groups_used: int = 1
    routed_scale: float = 1.0  # the routed experts' weights multiplied by this (routed_scaling_factor)
    shared_expert_gate: bool = True  # the shared expert scaled by a sigmoid gate (Qwen2-MoE; DeepSeek: not)

    def __post_init__(self):
        check_config(self)
        if not self.n_kv_head:
            object.__setattr__(self, "n_kv_head", self.n_head)
        if self.n_head % self.n_kv_head:
            raise ValueError(f"model.n_head ({self.n_head}) must be a multiple of model.n_kv_head ({self.n_kv_head})")
        if not self.head_dim:
            if self.d_model % self.n_head:
                raise ValueError(
                    f"model.d_model ({self.d_model}) must be divisible by model.n_head ({self.n_head}) "
                    f"unless model.head_dim is set"
                )
            object.__setattr__(self, "head_dim", self.d_model // self.n_head)
        if self.head_dim % 2:
            raise ValueError(f"model.head_dim ({self.head_dim}) must be even for rotary positions")
        if self.kv_lora_rank:
            if not 0 < self.rope_head_dim < self.head_dim or self.rope_head_dim % 2 or self.n_kv_head != self.n_head:
                raise ValueError(
                    "model.kv_lora_rank (latent attention) needs an even rope_head_dim below head_dim and "
                    "n_kv_head = n_head"
                )
            if not self.v_head_dim:
                object.__setattr__(self, "v_head_dim", self.head_dim)
        if not self.d_ff:
            object.__setattr__(self, "d_ff", -(-(8 * self.d_model // 3) // 64) * 64)
        if self.sliding_window < 0:
            raise ValueError(f"model.sliding_window must be >= 0, got {self.sliding_window}")
        if self.layer_types and (len(self.layer_types) != self.n_layer or set(self.layer_types) - {"sliding", "full"}):
            raise ValueError(f"model.layer_types must name 'sliding' or 'full' for each of the {self.n_layer} layers")
        if any(not 0 <= i < self.n_layer for i in self.nope_layers):
            raise ValueError(f"model.nope_layers must be layer numbers below {self.n_layer}")
        if not 0 < self.partial_rotary <= 1 or int(self.head_dim * self.partial_rotary) % 2:
            raise ValueError("model.partial_rotary must be in (0, 1] and rotate an even part of each head")
        if min(self.attn_softcap, self.logit_softcap, self.attn_scale, self.local_rope_theta) < 0:
            raise ValueError("model.attn_softcap, logit_softcap, attn_scale and local_rope_theta must be >= 0")
        check_rope(self.rope)
        rotated = int(self.head_dim * self.partial_rotary) // 2
        if self.rope.type == "longrope" and rotated not in {len(self.rope.short_factor), len(self.rope.long_factor)}:
            raise ValueError(
                f"longrope has {len(self.rope.short_factor)} factors for {rotated} rotary frequencies "
                "(head_dim x partial_rotary_factor / 2)"
            )
        if self.swiglu_limit < 0:
            raise ValueError(f"model.swiglu_limit must be >= 0, got {self.swiglu_limit}")
        if self.router_score == "sigmoid" and (self.router_aux_coef or self.router_z_coef):
            raise ValueError("model.router_aux_coef and router_z_coef are softmax routers' losses; set 0 for sigmoid")
        if self.n_experts and (
            self.n_experts % self.expert_groups or not 1 <= self.expert_groups_used <= self.expert_groups
        ):
            raise ValueError("model.expert_groups must divide n_experts, and expert_groups_used be 1 to expert_groups")
        if self.n_experts < 0 or min(self.router_aux_coef, self.router_z_coef) < 0:
            raise ValueError("model.n_experts, router_aux_coef and router_z_coef must be >= 0")
        if any(not 0 <= i < self.n_layer for i in self.dense_layers):
            raise ValueError(f"model.dense_layers must be layer numbers below {self.n_layer}")
        if self.n_experts:
            if not 1 <= self.experts_per_token <= self.n_experts:
                raise ValueError(
                    f"model.experts_per_token must be between 1 and model.n_experts ({self.n_experts}), "
                    f"got {self.experts_per_token}"
                )
            if self.sparse_step < 1 or min(self.expert_d_ff, self.shared_expert_d_ff) < 0:
                raise ValueError("model.sparse_step must be >= 1, expert_d_ff and shared_expert_d_ff >= 0")
            if not self.expert_d_ff:
                object.__setattr__(self, "expert_d_ff", self.d_ff)
        dense = [i for i in range(self.n_layer) if not self.has_experts(i)]
        if (self.expert_bias or self.swiglu_limit) and (dense or self.shared_expert_d_ff):
            raise ValueError(
                "model.expert_bias and swiglu_limit apply to routed experts only: set n_experts with no dense "
                "layers and no shared expert"
            )

    def has_experts(self, layer: int) -> bool:
        """Whether this layer's feed-forward is a mixture of experts."""
        return bool(self.n_experts) and layer not in self.dense_layers and (layer + 1) % self.sparse_step == 0

    def with_layers(self, n: int) -> LlamaConfig:
        """This model's first n layers (the memory plan probes one and two blocks); a mixture whose
        first layers are dense (DeepSeek-V3's 3 of 61) and every later one a mixture is probed with
        mixtures only, the layers that make up its depth."""
        prefix = self.dense_layers == tuple(range(len(self.dense_layers))) and self.sparse_step == 1
        dense = () if self.n_experts and prefix and len(self.dense_layers) < self.n_layer else self.dense_layers
        return replace(
            self,
            n_layer=n,
            layer_types=self.layer_types[:n],
            nope_layers=tuple(i for i in self.nope_layers if i < n),
            dense_layers=tuple(i for i in dense if i < n),
        )

    def window_of(self, layer: int) -> int:
        """The sliding window of one layer (0: it sees every earlier position)."""
        if self.layer_types:
            return self.sliding_window if self.layer_types[layer] == "sliding" else 0
        return self.sliding_window

    @property
    def rotary_dim(self) -> int:
        return self.rope_head_dim if self.kv_lora_rank else int(self.head_dim * self.partial_rotary)


class Llama(DecoderTraits, nn.Module):
    """Decoder-only transformer. forward() returns hidden states; logits() applies the LM head."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        if cfg.vocab_size <= 0:
            raise ValueError("model.vocab_size must be set (it is filled in from the tokenizer)")
        self.cfg = cfg
        rms = lambda d: make_norm("rmsnorm", d, cfg.layer_norm_eps)  # noqa: E731
        before, after = cfg.norms in ("pre", "both"), cfg.norms in ("post", "both")
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.rotary = Rotary(cfg.rotary_dim, cfg.rope, cfg.max_seq_len)
        local = any(cfg.window_of(i) for i in range(cfg.n_layer)) and cfg.local_rope_theta
        # Gemma 3's sliding layers turn by their own base, without the global layers' scaling
        self.local_rotary = (
            Rotary(cfg.rotary_dim, RopeScaling(cfg.local_rope_theta), cfg.max_seq_len) if local else None
        )
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(
            Block(
                _attention(cfg, i)
                if cfg.kv_lora_rank
                else Attention(
                    cfg.d_model,
                    cfg.n_head,
                    n_kv_head=cfg.n_kv_head,
                    head_dim=cfg.head_dim,
                    bias=cfg.qkv_bias,
                    out_bias=cfg.out_bias,
                    dropout=cfg.dropout,
                    qk_norm=rms if cfg.qk_norm else None,
                    qk_norm_whole=cfg.qk_norm_whole,
                    window=cfg.window_of(i),
                    scale=cfg.attn_scale or None,
                    softcap=cfg.attn_softcap,
                    sinks=cfg.attn_sinks,
                ),
                _feed_forward(cfg, i),
                rms(cfg.d_model) if before else None,
                rms(cfg.d_model) if before else None,
                prenorm=True,
                dropout=cfg.dropout,
                post_attn=rms(cfg.d_model) if after else None,
                post_mlp=rms(cfg.d_model) if after else None,
                residual_scale=cfg.residual_scale,
            )
            for i in range(cfg.n_layer)
        )
        self.ln_f = rms(cfg.d_model)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.tied = TiedTable()
        init_normal_(self)
        for moe in moe_layers(self):
            moe.reset_parameters()

    @property
    def logit_scale(self) -> float:  # what the fused losses read (objectives.losses.lm_head)
        return self.cfg.logit_scale

    @property
    def logit_softcap(self) -> float:
        return self.cfg.logit_softcap

    @property
    def lm_head_weight(self) -> Tensor:
        return self.tied.head(self.wte.weight) if self.lm_head is None else self.lm_head.weight

    def cache_stale(self, cached: int, total: int) -> bool:
        """LongRoPE turns by other frequencies once a sequence outgrows the pretrained context: a cache
        filled before that no longer holds this pass's keys (generate reads the sequence again)."""
        rope = self.cfg.rope
        return rope.type == "longrope" and cached <= rope.original_max < total

    @property
    def shortest_window(self) -> int:
        """The narrowest sliding window of any layer (0: none). A window counts keys by their distance
        in the row, which replies in one row (blocks.replies_to_one_prompt) do not keep for the later ones."""
        return min((w for w in map(self.cfg.window_of, range(self.cfg.n_layer)) if w), default=0)

    def new_caches(self, max_len: int | None = None) -> list[KVCache]:
        return [KVCache(max_len or self.cfg.max_seq_len) for _ in self.blocks]

    def forward(
        self,
        input_ids: Tensor,
        caches: list[KVCache] | None = None,
        all_layers: bool = False,
        doc_ids: Tensor | None = None,
        key_mask: Tensor | None = None,
        shared_prompt: Tensor | None = None,
        embeds: Tensor | None = None,
    ):
        """input_ids (B, T) -> hidden states (B, T, D); the arguments mean what they mean for GPT
        (blocks.decoder_positions): caches, every layer's output, packed documents, left padding.
        embeds (B, T, D): the input's embeddings in place of embed(input_ids) (a vision-language model
        puts its image features among them)."""
        cfg = self.cfg
        pos, mask = decoder_positions(input_ids, caches, cfg.max_seq_len, doc_ids, key_mask, shared_prompt)
        pos = pos if pos.dim() == 2 else pos[None]  # (B or 1, T)
        rope = self.rotary(pos)  # each (B or 1, T, rotary_dim)
        local_rope = self.local_rotary(pos) if self.local_rotary is not None else rope
        ropes = [None if i in cfg.nope_layers else local_rope if cfg.window_of(i) else rope for i in range(cfg.n_layer)]
        x = self.drop(self.embed(input_ids) if embeds is None else embeds)  # (B, T, D)
        call = lambda i, block, h: block(h, mask=mask, causal=True, cache=caches[i] if caches else None, rope=ropes[i])
        return through_blocks(x, self.blocks, call, all_layers, self.ln_f)

    def embed(self, input_ids: Tensor) -> Tensor:
        """(B, T) -> (B, T, D): the table's rows, scaled where the model scales them."""
        x = self.tied.lookup(input_ids, self.wte.weight) if self.lm_head is None else self.wte(input_ids)
        if self.cfg.embed_scale != 1.0:  # Gemma rounds sqrt(d_model) to the weights' precision first
            x = x * torch.tensor(self.cfg.embed_scale, dtype=x.dtype)
        return x

    def describe(self) -> str:
        """The banner's line for a mixture of experts ("" for a dense model)."""
        layers = moe_layers(self)
        if not layers:
            return ""
        r = layers[0].routing
        idle = sum(m.idle_parameters() for m in layers)
        total = sum(p.numel() for p in self.parameters())
        return (
            f"a mixture of experts: {r.n_experts} experts in {len(layers)} of {self.cfg.n_layer} layers, "
            f"{r.top_k} per token ({(total - idle) / 1e6:.2f}M of {total / 1e6:.2f}M parameters active), "
            f"load-balancing loss x {r.aux_coef:g}" + (f", z-loss x {r.z_coef:g}" if r.z_coef else "")
        )

    def flops_per_token(self, seq_len: int, target_len: int = 0) -> float:
        """Training FLOPs per token: every weight a token meets (rotary positions are computed, not
        learned; of each layer's experts, the k it is routed to); attention at the query width
        n_head x head_dim."""
        idle = sum(m.idle_parameters() for m in moe_layers(self))
        width = self.cfg.n_head * self.cfg.head_dim
        return dense_flops_per_token(self, self.cfg.n_layer, seq_len, width) - 6.0 * idle

    def logits(self, hidden: Tensor) -> Tensor:
        """(B, T, D) -> (B, T, vocab), scaled (Granite) and soft-capped (Gemma 2) where the model is."""
        out = hidden @ self.lm_head_weight.t()
        if self.cfg.logit_scale != 1.0:
            out = out * self.cfg.logit_scale
        if self.cfg.logit_softcap:
            out = torch.tanh(out / self.cfg.logit_softcap) * self.cfg.logit_softcap
        return out


def _attention(cfg: LlamaConfig, layer: int) -> nn.Module:
    """Layer `layer`'s latent attention (DeepSeek-V3's: cfg.kv_lora_rank set)."""
    return LatentAttention(
        cfg.d_model,
        cfg.n_head,
        nope_dim=cfg.head_dim - cfg.rope_head_dim,
        rope_dim=cfg.rope_head_dim,
        v_dim=cfg.v_head_dim,
        kv_rank=cfg.kv_lora_rank,
        q_rank=cfg.q_lora_rank,
        bias=cfg.out_bias,
        dropout=cfg.dropout,
        scale=cfg.attn_scale or None,
        interleaved=cfg.rope_interleave,
    )


def _feed_forward(cfg: LlamaConfig, layer: int) -> nn.Module:
    """Layer `layer`'s feed-forward: the gated MLP, or where the config has experts there, the MoE."""
    if not cfg.has_experts(layer):
        return MLP(cfg.d_model, cfg.d_ff, activation=cfg.activation, bias=cfg.mlp_bias, gated=True, dropout=cfg.dropout)
    routing = Routing(
        cfg.n_experts,
        cfg.experts_per_token,
        cfg.norm_topk,
        cfg.router_aux_coef,
        cfg.router_z_coef,
        cfg.router_score,
        cfg.expert_groups,
        cfg.expert_groups_used,
        cfg.routed_scale,
    )
    glu = Glu(cfg.activation, cfg.swiglu_alpha, cfg.swiglu_limit)
    return MoE(
        cfg.d_model,
        cfg.expert_d_ff,
        routing,
        shared_d_ff=cfg.shared_expert_d_ff,
        glu=glu,
        bias=cfg.expert_bias,
        shared_gate=cfg.shared_expert_gate,
    )
