"""The transformer parts every family shares: attention, MLP, norms, the residual block.

This is the only attention code in tfcli. BERT, GPT, T5 and ViT differ only in how their
builders wire these parts (pre- or post-norm, LayerNorm or RMSNorm, biases, activation,
what goes into the attention mask), never in the parts themselves.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import Tensor, nn

from .fused import RMSNorm, rotate

POSITIVE = (
    "n_layer",
    "n_head",
    "d_model",
    "max_seq_len",
    "image_size",
    "patch_size",
    "channels",
    "decoder_d_model",
    "decoder_n_layer",
    "decoder_n_head",
    "type_vocab_size",
    "relative_attention_max_distance",
)
NON_NEGATIVE = ("d_ff", "vocab_size", "n_decoder_layer", "d_kv", "decoder_d_ff")


def check_config(cfg) -> None:
    """The ranges every family's config shares (sizes >= 1, dropout in [0, 1), eps > 0), named by
    their recipe path; each config's __post_init__ calls this before its own checks."""
    for name in POSITIVE:
        if hasattr(cfg, name) and getattr(cfg, name) < 1:
            raise ValueError(f"model.{name} must be >= 1, got {getattr(cfg, name)!r}")
    for name in NON_NEGATIVE:
        if hasattr(cfg, name) and getattr(cfg, name) < 0:
            raise ValueError(f"model.{name} must be >= 0, got {getattr(cfg, name)!r}")
    if not 0 <= cfg.dropout < 1:
        raise ValueError(f"model.dropout must be in [0, 1), got {cfg.dropout!r}")
    if not cfg.layer_norm_eps > 0:
        raise ValueError(f"model.layer_norm_eps must be > 0, got {cfg.layer_norm_eps!r}")


class KVCache:
    """Keys and values of one attention layer, kept across decoding steps.

    Preallocated to `max_len` so that each new token costs one position of compute and
    no re-concatenation. For cross-attention it simply holds the projected encoder output.
    """

    def __init__(self, max_len: int):
        self.max_len = max_len
        self.k: Tensor | None = None  # (B, nh, max_len, hs)
        self.v: Tensor | None = None
        self.length = 0

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store k, v of shape (B, n_kv_head, T, hs) after the cached ones; return all so far."""
        B, nh, T, hs = k.shape
        if self.k is None:  # values as wide as they are (a latent cache's: its rotary key)
            self.k = k.new_empty(B, nh, self.max_len, hs)
            self.v = v.new_empty(B, v.size(1), self.max_len, v.size(-1))
        if self.length + T > self.max_len:
            raise ValueError(f"KV cache full: {self.length} + {T} > {self.max_len} positions")
        self.k[:, :, self.length : self.length + T] = k
        self.v[:, :, self.length : self.length + T] = v
        self.length += T
        return self.k[:, :, : self.length], self.v[:, :, : self.length]

    def select(self, rows: Tensor) -> None:
        """Keep the batch rows `rows` (B',), in that order, repeats allowed: one cached prefix then
        serves several continuations."""
        self.k, self.v = self.k.index_select(0, rows), self.v.index_select(0, rows)

    def rewind(self, length: int) -> None:
        """Forget every position from `length` on: one shared prefix, then several continuations."""
        self.length = min(self.length, length)


def padding_mask(attention_mask: Tensor) -> Tensor:
    """(B, Tk) of 1 = token, 0 = pad  ->  boolean (B, 1, 1, Tk), True where a key may be seen."""
    return attention_mask.bool()[:, None, None, :]


def causal_mask(t_query: int, t_key: int, device=None, window: int = 0) -> Tensor:
    """Boolean (Tq, Tk): query i (the last Tq of Tk positions) sees keys j <= its own position, and
    with a window only the last `window` of them (itself included)."""
    allowed = torch.ones(t_query, t_key, dtype=torch.bool, device=device).tril(diagonal=t_key - t_query)
    return allowed.triu(diagonal=t_key - t_query - window + 1) if window else allowed


FEW_ROWS = 32  # up to this many rows of input, a CPU linear runs as a batch of weight slices (below)
SLICED_MIN_WEIGHT = 1 << 17  # elements; a smaller weight is read faster whole than the slices start (a
# 256 x 256 one: 6 us whole, 13 sliced; 768 x 256: 57 us whole, 35 sliced, 60 distinct weights, 2 cores)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """F.linear(x, weight, bias), which on a multi-threaded CPU with few rows of x (decoding: one
    position per sequence) computes the product as a batch of row slices of the weight, one per
    torch thread. MKL runs such a product as a matrix-vector product on one thread only, and the
    slices read the weights nearly twice as fast on 2 cores (docs/results/measured.md). The
    slices are views: nothing is copied. Beyond FEW_ROWS rows MKL's own threading is faster, and
    below SLICED_MIN_WEIGHT elements one thread is. Under torch.compile it is F.linear: asking for the
    thread count would break the graph at every linear."""
    if torch.compiler.is_compiling() or x.device.type != "cpu":
        return F.linear(x, weight, bias)
    parts, rows = torch.get_num_threads(), x.numel() // max(1, x.size(-1))
    out, d_in = weight.shape
    if (
        parts < 2
        or not 0 < rows <= FEW_ROWS
        or weight.numel() < SLICED_MIN_WEIGHT
        or out % parts
        or not weight.is_contiguous()
        or x.dtype != weight.dtype
    ):
        return F.linear(x, weight, bias)
    slices = weight.view(parts, out // parts, d_in).transpose(1, 2)  # (P, D_in, out/P), a view
    y = product_by_slices(x.reshape(rows, d_in), slices).view(*x.shape[:-1], out)
    return y if bias is None else y + bias


def product_by_slices(x: Tensor, slices: Tensor) -> Tensor:
    """x (rows, D_in) times each of P column slices (P, D_in, W) of a weight -> (rows, P * W), as one
    batched product, which torch spreads over its threads (one matrix product MKL would not)."""
    p = slices.size(0)
    y = torch.bmm(x.expand(p, *x.shape), slices)  # (P, rows, W)
    return y.transpose(0, 1).reshape(x.size(0), -1)


class _TiedLookup(torch.autograd.Function):
    """The rows of a table that is also the output layer (tied embeddings), and the table again: the
    output layer reads that second output, so both of the table's gradients arrive at this one node.
    Its backward adds the rows' gradients into the output layer's (V, D) gradient in place, where
    autograd would build a second (V, D) gradient (zeros, then the rows) and add the two: on the CPU a
    fresh (V, D) tensor a step, whose pages the kernel faults in (1.0 s of a Gemma-3-270M step)."""

    @staticmethod
    def forward(ctx, ids: Tensor, weight: Tensor, table: TiedTable):
        ctx.save_for_backward(ids)  # saved, so that a second backward through a used pass fails loudly
        ctx.shape, ctx.dtype, ctx.table = weight.shape, weight.dtype, table
        return F.embedding(ids, weight), weight.view_as(weight)  # (..., D), (V, D)

    @staticmethod
    def backward(ctx, grad_rows: Tensor | None, grad_weight: Tensor | None):
        (ids,) = ctx.saved_tensors
        if ctx.table.alias is not None and ctx.table.alias.grad_fn is ctx:
            ctx.table.alias = None  # this pass is spent: what reads the output layer next reads the table
        if grad_weight is None:  # the output layer read the table itself (or nothing): the rows alone
            grad_weight = torch.zeros(ctx.shape, dtype=ctx.dtype, device=ids.device)
        if grad_rows is not None:  # in place: the output layer's gradient is a buffer no one else reads
            grad_weight.index_add_(0, ids.reshape(-1), grad_rows.reshape(-1, grad_rows.size(-1)).to(ctx.dtype))
        return None, grad_weight, None


class TiedTable:
    """Where a model's token table is also its output layer: the alias of the table that this training
    pass's output layer should read (`_TiedLookup`), or None (read the table itself); its backward
    clears it. Only a CPU pass that trains the table takes it, eagerly and in one process; a copy of
    the model starts empty."""

    def __init__(self):
        self.alias: Tensor | None = None

    def lookup(self, ids: Tensor, weight: Tensor) -> Tensor:
        """(B, T) -> (B, T, D), the table's rows; the alias kept for `head`."""
        self.alias = None
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        trains_here = torch.is_grad_enabled() and weight.requires_grad and weight.device.type == "cpu"
        if not trains_here or distributed or torch.compiler.is_compiling():
            return F.embedding(ids, weight)
        rows, self.alias = _TiedLookup.apply(ids, weight, self)
        return rows

    def head(self, weight: Tensor) -> Tensor:
        """The output layer's weight: this pass's alias while gradients are on, else the table."""
        return self.alias if self.alias is not None and torch.is_grad_enabled() else weight

    def __deepcopy__(self, memo) -> TiedTable:
        return TiedTable()

    def __getstate__(self) -> dict:
        return {"alias": None}


class Linear(nn.Linear):
    """nn.Linear (same parameters, same state dict) computed by `linear`: fast at decoding on a CPU."""

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)


class Attention(nn.Module):
    """Multi-head scaled dot-product attention, self or cross, through one fused SDPA call, built
    from parts (as torchtune's MultiHeadAttention and litgpt's CausalSelfAttention):

    - the projections laid out explicitly: `n_head` query heads and `n_kv_head` key/value heads of
      `head_dim` each (grouped-query attention when n_kv_head < n_head, multi-query at 1); self-
      attention holds them in one fused `qkv` linear of unequal parts, `layout` names their widths
      (what adapters and the Hugging Face converter split by);
    - optional biases on q/k/v (`bias`) and on the output (`out_bias`, default: as `bias`);
    - optional norms of q and k (`qk_norm`: a factory of a norm), per head over head_dim (Qwen3,
      Gemma 3) or, with `qk_norm_whole`, over the whole projection before it is split into heads
      (OLMo 2);
    - rotary positions: forward(rope=(cos, sin)) rotates q and k (models/rotary.py makes them), all
      of each head or, when cos is narrower than a head, its first dimensions only (Phi's partial
      rotary);
    - an optional sliding window: a causal query sees at most the last `window` keys, itself
      included; a bidirectional one the `window` keys on either side (ModernBERT's local layers);
    - optional soft-capping of the scores, cap * tanh(scores / cap) (Gemma 2), and optional attention
      sinks (gpt-oss): one learned logit per head that joins every query's softmax and attends to
      nothing, so a head may put weight nowhere. SDPA can do neither, so those layers compute the
      scores themselves.

    `mask` is boolean (True = may attend) or additive float (T5's position bias), broadcastable
    to (B, nh, Tq, Tk). `causal` masks future keys. `scale=None` is 1/sqrt(head_dim).
    """

    def __init__(
        self,
        d_model: int,
        n_head: int,
        *,
        n_kv_head: int | None = None,
        head_dim: int | None = None,
        bias: bool = True,
        out_bias: bool | None = None,
        dropout: float = 0.0,
        cross: bool = False,
        scale: float | None = None,
        qk_norm: Callable[[int], nn.Module] | None = None,
        qk_norm_whole: bool = False,
        window: int = 0,
        softcap: float = 0.0,
        sinks: bool = False,
    ):
        super().__init__()
        self.n_head, self.n_kv_head = n_head, n_kv_head or n_head
        if self.n_head % self.n_kv_head:
            raise ValueError(f"model.n_head ({n_head}) must be a multiple of model.n_kv_head ({self.n_kv_head})")
        self.head_dim = head_dim or d_model // n_head
        self.inner = n_head * self.head_dim  # query (and output) width
        self.kv_inner = self.n_kv_head * self.head_dim  # key and value width each
        self.cross, self.scale, self.dropout, self.window, self.softcap = cross, scale, dropout, window, softcap
        if cross:
            self.q = Linear(d_model, self.inner, bias=bias)
            self.kv = Linear(d_model, 2 * self.kv_inner, bias=bias)
        else:
            self.qkv = Linear(d_model, self.inner + 2 * self.kv_inner, bias=bias)
        self.out = Linear(self.inner, d_model, bias=bias if out_bias is None else out_bias)
        self.qk_norm_whole = qk_norm_whole
        self.q_norm = qk_norm(self.inner if qk_norm_whole else self.head_dim) if qk_norm else None
        self.k_norm = qk_norm(self.kv_inner if qk_norm_whole else self.head_dim) if qk_norm else None
        self.sinks = nn.Parameter(torch.zeros(n_head)) if sinks else None  # (nh,) logits

    def layout(self, leaf: str) -> tuple[tuple[str, int], ...]:
        """The parts a projection holds and their widths, in output order ('qkv' -> q, k, v)."""
        q, kv = ("q", self.inner), (("k", self.kv_inner), ("v", self.kv_inner))
        return {"qkv": (q, *kv), "kv": kv, "q": (q,), "out": (("o", self.out.out_features),)}[leaf]

    def _heads(self, x: Tensor, n: int) -> Tensor:
        B, T, _ = x.shape  # (B, T, n*hs) -> (B, n, T, hs)
        return x.view(B, T, n, self.head_dim).transpose(1, 2)

    def _project(
        self, x: Tensor, context: Tensor | None, cache: KVCache | None, rope: tuple[Tensor, Tensor] | None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """q (B, nh, T, hs) and the keys and values to attend to (B, n_kv, Tk, hs), cache included."""
        if self.cross:
            q = self._heads(self.q(x), self.n_head)
            if cache is not None and cache.k is not None:
                return q, cache.k, cache.v  # encoder output projected once, reused every step
            k, v = (self._heads(t, self.n_kv_head) for t in self.kv(context).split(self.kv_inner, dim=-1))
            if cache is not None:
                cache.k, cache.v, cache.length = k, v, k.size(2)
            return q, k, v
        q, k, v = self.qkv(x).split((self.inner, self.kv_inner, self.kv_inner), dim=-1)
        if self.q_norm is not None and self.qk_norm_whole:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = self._heads(q, self.n_head), self._heads(k, self.n_kv_head), self._heads(v, self.n_kv_head)
        if self.q_norm is not None and not self.qk_norm_whole:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = _rotate(q, rope), _rotate(k, rope)
        if rope is not None and self.q_norm is None:
            # q and k are new tensors now; the values, a view, would keep the whole fused projection
            # (q's and k's columns too) alive for backward: their own copy keeps a fifth of it (SmolLM2).
            # Copied with or without gradients, so that a policy and its reference pass (DPO, GRPO)
            # hand attention the same layouts. (Qwen3's q/k norms keep views of the projection anyway.)
            v = v.contiguous()
        if cache is not None:
            k, v = cache.append(k, v)
        return q, k, v

    def forward(
        self,
        x: Tensor,
        *,
        context: Tensor | None = None,
        mask: Tensor | None = None,
        causal: bool = False,
        cache: KVCache | None = None,
        rope: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor:
        B, T, _ = x.shape
        q, k, v = self._project(x, context, cache, rope)
        t_key = k.size(2)
        is_causal = False
        if causal:
            window = self.window if self.window and t_key > self.window else 0  # a window longer than the keys is moot
            if mask is None and t_key == T and not window:
                is_causal = True  # fast path: SDPA builds the triangle itself
            elif T > 1 or window:
                allowed = causal_mask(T, t_key, x.device, window)
                mask = allowed if mask is None else _combine(mask, allowed)
        elif self.window and t_key > self.window + 1:  # bidirectional: `window` keys on either side
            offset = torch.arange(t_key, device=x.device) - torch.arange(t_key - T, t_key, device=x.device)[:, None]
            allowed = offset.abs() <= self.window  # (T, Tk)
            mask = allowed if mask is None else _combine(mask, allowed)
        if self.softcap or self.sinks is not None:
            if is_causal:
                mask = causal_mask(T, t_key, x.device)
            y = self._eager_attention(q, k, v, mask)
        else:
            y = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=mask,
                dropout_p=self.dropout if self.training else 0.0,
                is_causal=is_causal,
                scale=self.scale,
                enable_gqa=self.n_kv_head != self.n_head,
            )  # (B, nh, T, hs)
        return self.out(y.transpose(1, 2).reshape(B, T, self.inner))

    def _eager_attention(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
        """Attention with soft-capped scores and/or sinks: softmax over [cap * tanh(q k^T scale / cap)
        + mask, sink] (the sink's column then dropped) times v."""
        groups = self.n_head // self.n_kv_head
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)  # (B, nh, Tk, hs)
        scale = self.scale if self.scale is not None else self.head_dim**-0.5
        scores = q @ k.transpose(-2, -1) * scale  # (B, nh, T, Tk)
        if self.softcap:
            scores = torch.tanh(scores / self.softcap) * self.softcap
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
        if self.sinks is not None:
            sink = self.sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
            scores = torch.cat((scores, sink), dim=-1)
        weights = scores.softmax(-1, dtype=torch.float32).to(q.dtype)
        if self.sinks is not None:
            weights = weights[..., :-1]
        return F.dropout(weights, self.dropout, self.training) @ v  # (B, nh, T, hs)


def _rotate(x: Tensor, rope: tuple[Tensor, Tensor]) -> Tensor:
    """Rotary positions on the first cos.size(-1) dimensions of each head (B, n, T, hs): all of them,
    or a part (partial rotary), the rest passed through."""
    width = rope[0].size(-1)
    if width == x.size(-1):
        return rotate(x, *rope)
    return torch.cat((rotate(x[..., :width], *rope), x[..., width:]), dim=-1)


def decoder_positions(
    input_ids: Tensor,
    caches: list | None,
    context: int,
    doc_ids: Tensor | None = None,
    key_mask: Tensor | None = None,
    shared_prompt: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """A causal decoder's positions and attention mask for input_ids (B, T) after the cached tokens:
    plain (positions start.., no mask: SDPA's causal fast path), packed documents (doc_ids (B, T):
    positions restart per document, (B, 1, T, T) within-document mask), left-padded batched
    generation (key_mask (B, cached + T) of 1 = token: positions count real tokens, pads unseen), or
    replies to one prompt in a row (shared_prompt, see replies_to_one_prompt)."""
    T = input_ids.size(1)
    if shared_prompt is not None:
        return replies_to_one_prompt(shared_prompt, T, context)
    start = caches[0].length if caches else 0
    if start + T > context:
        raise ValueError(f"sequence of {start + T} tokens is longer than the context ({context})")
    if key_mask is not None:
        pos = (key_mask.cumsum(1) - 1).clamp(min=0)[:, start:]  # (B, T): each row's own positions
        return pos, key_mask.bool()[:, None, None, :] | own_key(T, start + T, input_ids.device)  # (B, 1, T, Tk)
    if doc_ids is None:
        return torch.arange(start, start + T, device=input_ids.device), None
    return document_positions(doc_ids), (doc_ids[:, :, None] == doc_ids[:, None, :])[:, None]  # (B, 1, T, T)


def replies_to_one_prompt(shared_prompt: Tensor, T: int, context: int) -> tuple[Tensor, Tensor]:
    """Positions (B, T) and mask (B, 1, T, T) of rows holding a prompt, then K replies to it one after
    another (then padding): shared_prompt (B, K) is where each reply starts, the prompt [0, first
    start), reply k from its start to the next one's (the last to the row's end; a start at T: no such
    reply). Every reply's positions continue the prompt's and no reply sees another, so each meets what
    it would alone after the prompt, and the prompt is read once for all of them (DPO's chosen and
    rejected, K = 2; GRPO's completions of one prompt)."""
    idx = torch.arange(T, device=shared_prompt.device)  # (T,)
    starts = shared_prompt  # (B, K), non-decreasing along K
    reply = (idx[None, :, None] >= starts[:, None, :]).sum(-1) - 1  # (B, T): -1 in the prompt
    start = starts.gather(1, reply.clamp(min=0))  # (B, T): where each token's reply starts
    followed = starts[:, 1:] < T  # a reply with another after it: all tokens (the last may hold padding)
    ends = torch.where(followed, starts[:, 1:] - starts[:, :-1] + starts[:, :1], 0)  # (B, K - 1)
    if ends.numel() and int(ends.max()) > context:
        raise ValueError(f"a prompt and reply of {int(ends.max())} tokens are longer than the context ({context})")
    pos = torch.where(reply >= 0, idx - start + starts[:, :1], idx).clamp(max=context - 1)  # (pads past the end: any)
    apart = (reply[:, :, None] >= 0) & (reply[:, None, :] >= 0) & (reply[:, :, None] != reply[:, None, :])
    return pos, ~apart[:, None]  # (B, 1, T, T)


def own_key(t_query: int, t_key: int, device) -> Tensor:
    """(Tq, Tk) True where a query meets its own key: a left pad then sees itself, so no row of its
    attention is all masked (that would give NaN, which the next layer's keys would carry on)."""
    shift = t_key - t_query  # the queries are the last Tq of the Tk positions
    return torch.ones(t_query, t_key, dtype=torch.bool, device=device).tril(shift).triu(shift)


def document_positions(doc_ids: Tensor) -> Tensor:
    """(B, T) document numbers -> (B, T) positions counted from each document's first token."""
    T = doc_ids.size(1)
    idx = torch.arange(T, device=doc_ids.device).expand_as(doc_ids)
    first = torch.ones_like(doc_ids, dtype=torch.bool)
    first[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    starts = torch.cummax(torch.where(first, idx, torch.zeros_like(idx)), dim=1).values
    return idx - starts


def _combine(mask: Tensor, allowed: Tensor) -> Tensor:
    """Merge a boolean or additive mask with a boolean `allowed` pattern."""
    if mask.dtype == torch.bool:
        return mask & allowed
    return mask.masked_fill(~allowed, float("-inf"))


ACTIVATIONS = {
    "gelu": lambda x: F.gelu(x),
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),  # GPT-2's "gelu_new"
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),  # CLIP's
    "relu": F.relu,
    "silu": F.silu,
}
# the backward, as autograd runs it, of each activation whose backward reads its input: (upstream
# gradient, input) -> the input's gradient (ReLU's reads its output, which autograd keeps anyway)
ACTIVATION_GRADS = {
    "gelu": lambda g, x: torch.ops.aten.gelu_backward(g, x),
    "gelu_tanh": lambda g, x: torch.ops.aten.gelu_backward(g, x, approximate="tanh"),
    "silu": lambda g, x: torch.ops.aten.silu_backward(g, x),
}


class GatedActivation(torch.autograd.Function):
    """act(gate) * up, keeping gate and up for the backward pass and recomputing act(gate) there (as
    liger-kernel's SwiGLU does): autograd would also keep act(gate), a third (B, T, d_ff) tensor. The
    gradients are autograd's own, bit for bit (the same backward kernels, on the same values)."""

    @staticmethod
    def forward(ctx, gate: Tensor, up: Tensor, activation: str) -> Tensor:
        ctx.save_for_backward(gate, up)
        ctx.activation = activation
        return ACTIVATIONS[activation](gate).mul_(up)  # in place: one (B, T, d_ff) tensor fewer to fault in

    @staticmethod
    def backward(ctx, grad: Tensor):
        gate, up = ctx.saved_tensors
        d_gate = ACTIVATION_GRADS[ctx.activation](grad * up, gate)
        return d_gate, ACTIVATIONS[ctx.activation](gate).mul_(grad), None


class MLP(nn.Module):
    """Position-wise feed-forward: up, activation (optionally gated as in T5 v1.1), down."""

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        *,
        activation: str = "gelu",
        bias: bool = True,
        gated: bool = False,
        dropout: float = 0.0,
    ):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r}; choose from {sorted(ACTIVATIONS)}")
        self.activation, self.act = activation, ACTIVATIONS[activation]
        self.up = Linear(d_model, d_ff, bias=bias)
        self.gate = Linear(d_model, d_ff, bias=bias) if gated else None
        self.down = Linear(d_ff, d_model, bias=bias)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        if self.gate is None:
            return self.down(self.drop(self.act(self.up(x))))
        if self.activation not in ACTIVATION_GRADS:
            return self.down(self.drop(self.act(self.gate(x)) * self.up(x)))
        return self.down(self.drop(GatedActivation.apply(self.gate(x), self.up(x), self.activation)))  # (..., d_ff)


def make_norm(kind: str, d: int, eps: float, bias: bool = True) -> nn.Module:
    """'layernorm' (BERT, GPT, ViT) or 'rmsnorm' (T5: no centring, no bias)."""
    if kind == "layernorm":
        return nn.LayerNorm(d, eps=eps, bias=bias)
    if kind == "rmsnorm":
        return RMSNorm(d, eps=eps)
    raise ValueError(f"unknown norm {kind!r}; choose 'layernorm' or 'rmsnorm'")


class Block(nn.Module):
    """Residual block: self-attention, optional cross-attention, MLP.

    prenorm=True (GPT, T5, ViT, Llama): x + f(norm(x)); with post norms also on f's output,
    x + post(f(norm(x))) (Gemma's sandwich), and with no pre norm x + post(f(x)) (OLMo 2); the branch
    scaled by `residual_scale` before it is added (Granite). prenorm=False (BERT): norm(x + f(x)).
    """

    def __init__(
        self,
        attn: Attention,
        mlp: MLP,
        norm_attn: nn.Module | None,
        norm_mlp: nn.Module | None,
        *,
        cross_attn: Attention | None = None,
        norm_cross: nn.Module | None = None,
        prenorm: bool = True,
        dropout: float = 0.0,
        post_attn: nn.Module | None = None,
        post_mlp: nn.Module | None = None,
        residual_scale: float = 1.0,
    ):
        super().__init__()
        self.attn, self.mlp = attn, mlp
        self.norm_attn, self.norm_mlp = norm_attn, norm_mlp
        self.post_attn, self.post_mlp = post_attn, post_mlp
        self.cross_attn, self.norm_cross = cross_attn, norm_cross
        self.prenorm, self.residual_scale = prenorm, residual_scale
        self.drop = nn.Dropout(dropout)
        self.checkpointing = False  # recompute activations in the backward pass (train.activation_checkpointing)

    def _residual(self, x: Tensor, norm: nn.Module | None, f, post: nn.Module | None = None) -> Tensor:
        if not self.prenorm:
            return norm(x + self.drop(f(x)))
        h = f(norm(x) if norm is not None else x)  # (B, T, D)
        h = self.drop(post(h) if post is not None else h)
        return x + h if self.residual_scale == 1.0 else x + h * self.residual_scale

    def forward(
        self,
        x: Tensor,
        *,
        mask: Tensor | None = None,
        causal: bool = False,
        cache: KVCache | None = None,
        context: Tensor | None = None,
        context_mask: Tensor | None = None,
        cross_cache: KVCache | None = None,
        rope: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor:
        kwargs = dict(
            mask=mask,
            causal=causal,
            cache=cache,
            context=context,
            context_mask=context_mask,
            cross_cache=cross_cache,
            rope=rope,
        )
        if self.checkpointing and self.training and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(self._forward, x, use_reentrant=False, **kwargs)
        return self._forward(x, **kwargs)

    def _forward(
        self,
        x: Tensor,
        *,
        mask: Tensor | None,
        causal: bool,
        cache: KVCache | None,
        context: Tensor | None,
        context_mask: Tensor | None,
        cross_cache: KVCache | None,
        rope: tuple[Tensor, Tensor] | None,
    ) -> Tensor:
        attend = lambda h: self.attn(h, mask=mask, causal=causal, cache=cache, rope=rope)  # noqa: E731
        x = self._residual(x, self.norm_attn, attend, self.post_attn)
        if self.cross_attn is not None:
            x = self._residual(
                x, self.norm_cross, lambda h: self.cross_attn(h, context=context, mask=context_mask, cache=cross_cache)
            )
        return self._residual(x, self.norm_mlp, self.mlp, self.post_mlp)


def through_blocks(
    x: Tensor,
    blocks: nn.ModuleList,
    call: Callable[[int, nn.Module, Tensor], Tensor],
    all_layers: bool,
    final: Callable[[Tensor], Tensor] = lambda h: h,
):
    """x (B, T, D) through every block, call(i, block, x) -> final(the last block's output) (B, T, D),
    or with all_layers final() of x and of every block's output (n_layer + 1 of them). Only all_layers
    keeps them: without gradients (a frozen reference's pass, evaluation, generation) each output is
    freed as soon as the next block has read it, so the pass peaks at one block's activations."""
    layers = [x] if all_layers else None
    for i, block in enumerate(blocks):
        x = call(i, block, x)
        if layers is not None:
            layers.append(x)
    return [final(h) for h in layers] if layers is not None else final(x)


def init_normal_(module: nn.Module, std: float = 0.02) -> None:
    """GPT-2/BERT initialisation: N(0, std) weights, zero biases, unit norms."""
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=std)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, (nn.LayerNorm, nn.RMSNorm)):
            if m.weight is not None:
                nn.init.ones_(m.weight)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)


def scale_residual_projections_(blocks: nn.ModuleList, n_layer: int, std: float = 0.02) -> None:
    """GPT-2: residual output projections get std / sqrt(2 * n_layer)."""
    for block in blocks:
        for proj in (block.attn.out, block.mlp.down):
            nn.init.normal_(proj.weight, mean=0.0, std=std / math.sqrt(2 * n_layer))


def dense_flops_per_token(module: nn.Module, n_layer: int, seq_len: int, width: int, lookups: tuple = ()) -> float:
    """Training FLOPs per token of a stack of blocks (torchtitan's get_nparams_and_flops, PaLM appendix
    B): 6 N (forward 2 + backward 4 per parameter; N without the lookup tables in `lookups`, learned
    positions, which multiply nothing) plus attention's 12 L T D (D the query width)."""
    n = sum(p.numel() for p in module.parameters()) - sum(t.weight.numel() for t in lookups)
    return 6.0 * n + 12.0 * n_layer * seq_len * width
