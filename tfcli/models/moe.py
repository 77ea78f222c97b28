"""A mixture-of-experts feed-forward (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE): a linear router picks
each token's top-k experts, whose gated MLPs run on their tokens only; their outputs are summed by the
router's weights, plus (Qwen2-MoE) a shared expert every token passes through, scaled by its own
sigmoid gate. gpt-oss adds biases to the router and to every expert's three projections, and gates
its experts with a clamped SwiGLU (`Glu`).

The experts are stacked ((E, d_ff, d) for gate and up, (E, d, d_ff) for down), as transformers' own
modules and llama.cpp's GGUF hold them. Tokens are sorted by expert once, so each expert multiplies one
contiguous run of rows (a grouped product, expert by expert), and the results go back in one
index_add. The router's training signal, as transformers computes it: Switch Transformer's load-
balancing loss over every MoE layer's router logits (router_aux_coef), and optionally ST-MoE's z-loss
(router_z_coef); `routing_losses` collects them after a training pass, and `expert_load` counts the
tokens each layer's experts received (a collapse shows as one expert taking most of them).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .blocks import ACTIVATION_GRADS, ACTIVATIONS, MLP, GatedActivation
from .nf4 import linear_nf4, to_nf4


@dataclass(frozen=True)
class Glu:
    """An expert's gated activation: act(gate) * up, or gpt-oss's clamped SwiGLU, (up + 1) *
    g * sigmoid(alpha g) with g = min(gate, limit) and up clamped to [-limit, limit] (limit 0: the
    plain act(gate) * up)."""

    activation: str = "silu"
    alpha: float = 1.702
    limit: float = 0.0

    def __call__(self, gate: Tensor, up: Tensor) -> Tensor:
        if self.limit:
            gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
            return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))
        if self.activation in ACTIVATION_GRADS:
            return GatedActivation.apply(gate, up, self.activation)
        return ACTIVATIONS[self.activation](gate) * up


@dataclass(frozen=True)
class Routing:
    """How a router weighs its choice: softmax over all experts, then the top k, renormalised to sum to
    one where norm_topk (Mixtral, Qwen3-MoE) or kept as they are (OLMoE, Qwen2-MoE). DeepSeek-V3's:
    each expert's sigmoid score, the top k chosen by score plus a fixed correction bias among the
    best `topk_groups` of `groups` groups (a group ranked by its two best), weighed by their scores
    (renormalised where norm_topk) times `scale`."""

    n_experts: int
    top_k: int
    norm_topk: bool = False
    aux_coef: float = 0.0  # the load-balancing loss's weight in the training loss
    z_coef: float = 0.0  # the router z-loss's weight
    score: str = "softmax"  # or "sigmoid" (DeepSeek-V3)
    groups: int = 1
    topk_groups: int = 1
    scale: float = 1.0


class StackedExperts(nn.Module):
    """E gated MLPs, their weights stacked. forward(x_sorted, counts): rows already grouped by expert,
    counts[e] rows for expert e."""

    def __init__(self, n: int, d_model: int, d_ff: int, glu: Glu, bias: bool = False):
        super().__init__()
        self.glu = glu
        self.gate = nn.Parameter(torch.empty(n, d_ff, d_model))
        self.up = nn.Parameter(torch.empty(n, d_ff, d_model))
        self.down = nn.Parameter(torch.empty(n, d_model, d_ff))
        # gpt-oss: each expert's projections have biases, (E, out) each
        self.gate_bias = nn.Parameter(torch.zeros(n, d_ff)) if bias else None
        self.up_bias = nn.Parameter(torch.zeros(n, d_ff)) if bias else None
        self.down_bias = nn.Parameter(torch.zeros(n, d_model)) if bias else None
        self.adapters: nn.Module | None = None  # per-expert LoRA (adapters.ExpertLoRA) when one is placed here

    def shape_of(self, part: str) -> tuple[int, int, int]:
        """(experts, out, in) of `part` (gate, up or down)."""
        w = getattr(self, part)
        return (len(w), *w[0].shape) if self.quantized else tuple(w.shape)

    @property
    def quantized(self) -> bool:
        return isinstance(self.down, nn.ParameterList)

    def product(self, x: Tensor, counts: list[int], part: str) -> Tensor:
        """x (N, in), rows grouped by expert (counts[e] for expert e) -> (N, out): each group through its
        expert's `part`, plus its adapter's update where there is one."""
        w = getattr(self, part)
        if self.quantized:
            pieces = [linear_nf4(rows, w[e]) for e, rows in enumerate(x.split(counts)) if counts[e]]
            y = torch.cat(pieces) if pieces else x.new_zeros(0, w[0].shape[0])
        elif torch.is_grad_enabled():
            y = GroupedProduct.apply(x, w, counts)
        else:
            y = grouped_product(x, w, counts)
        bias = getattr(self, f"{part}_bias")
        if bias is not None:  # each row its expert's bias
            y = y + bias.repeat_interleave(torch.tensor(counts, device=x.device), dim=0, output_size=len(x))
        update = self.adapters.product(x, counts, part) if self.adapters is not None else None
        return y if update is None else y + update

    def quantize(self) -> None:
        """Freeze every expert's weights in 4-bit NF4 (QLoRA), one NF4 tensor per expert and part."""
        for part in ("gate", "up", "down"):
            w = getattr(self, part).detach()
            held = [nn.Parameter(to_nf4(w[e].clone()), requires_grad=False) for e in range(len(w))]  # own storage each
            delattr(self, part)
            setattr(self, part, nn.ParameterList(held))

    def merge_adapters(self) -> None:
        """Fold the adapters into plain full-precision stacks (dequantized if NF4): what export writes."""
        if self.adapters is None and not self.quantized:
            return
        for part in ("gate", "up", "down"):
            w = getattr(self, part)
            plain = torch.stack([x.get_original_weight() for x in w]) if self.quantized else w.detach().clone()
            if self.adapters is not None and part in self.adapters.lora_a:
                plain += self.adapters.delta(part).detach().to(plain.dtype)
            delattr(self, part)
            setattr(self, part, nn.Parameter(plain))
        self.adapters = None

    def forward(self, x: Tensor, counts: list[int]) -> Tensor:
        gate, up = self.product(x, counts, "gate"), self.product(x, counts, "up")  # (N, d_ff) each
        return self.product(self.glu(gate, up), counts, "down")  # (N, D)


def grouped_product(x: Tensor, w: Tensor, counts: list[int]) -> Tensor:
    """x (N, in), rows grouped by expert (counts[e] each), each group times w[e]^T -> (N, out)."""
    out = x.new_empty(x.shape[0], w.shape[1])
    for e, (rows, into) in enumerate(zip(x.split(counts), out.split(counts))):
        if counts[e]:
            torch.mm(rows, w[e].t(), out=into)
    return out


class GroupedProduct(torch.autograd.Function):
    """x (N, in), rows grouped by expert (counts[e] rows for expert e), times each group's expert of the
    stack w (E, out, in) transposed -> (N, out): one product per expert, written straight into the
    output, and in the backward pass each expert's weight gradient written straight into one (E, out,
    in) tensor (autograd through w[e] or an unbind would build or stack a stack-sized one more)."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, counts: list[int]) -> Tensor:
        ctx.save_for_backward(x, w)
        ctx.counts = counts
        return grouped_product(x, w, counts)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, w = ctx.saved_tensors
        counts, grad = ctx.counts, grad.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = torch.empty_like(x)
            for e, (g, into) in enumerate(zip(grad.split(counts), dx.split(counts))):
                if counts[e]:
                    torch.mm(g, w[e], out=into)
        if ctx.needs_input_grad[1]:
            dw = torch.empty_like(w)
            for e, (g, rows) in enumerate(zip(grad.split(counts), x.split(counts))):
                if counts[e]:
                    torch.mm(g.t(), rows, out=dw[e])
                else:
                    dw[e].zero_()  # an expert no token reached
        return dx, dw, None


class MoE(nn.Module):
    """x (..., D) -> (..., D): each token through its top-k experts, weighted by the router."""

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        routing: Routing,
        *,
        activation: str = "silu",
        shared_d_ff: int = 0,
        glu: Glu | None = None,
        bias: bool = False,
        shared_gate: bool = True,
    ):
        super().__init__()
        self.routing = routing
        self.router = nn.Linear(d_model, routing.n_experts, bias=bias)
        self.experts = StackedExperts(routing.n_experts, d_model, d_ff, glu or Glu(activation), bias)
        self.shared = MLP(d_model, shared_d_ff, activation=activation, bias=False, gated=True) if shared_d_ff else None
        # Qwen2-MoE scales its shared expert by a sigmoid gate; DeepSeek-V3 adds its shared experts as they are
        self.shared_gate = nn.Linear(d_model, 1, bias=False) if shared_d_ff and shared_gate else None
        # DeepSeek-V3's correction bias: shifts which experts are chosen, not their weights (fixed here:
        # DeepSeek moves it by the experts' load while pretraining, not by gradients)
        self.score_bias = nn.Buffer(torch.zeros(routing.n_experts)) if routing.score == "sigmoid" else None
        self.routed: list[Tensor] = []  # this training pass's router logits (N, E), for routing_losses
        self.load: Tensor | None = None  # tokens per expert while expert_load counts (E,)

    def reset_parameters(self, std: float = 0.02) -> None:
        for p in (self.experts.gate, self.experts.up, self.experts.down):
            nn.init.normal_(p, mean=0.0, std=std)

    def idle_parameters(self) -> float:
        """The expert weights a token does not meet (all but its k experts'), on average."""
        n, out, inner = self.experts.shape_of("gate")
        return 3 * out * inner * (n - self.routing.top_k)

    def choose(self, logits: Tensor) -> tuple[Tensor, Tensor]:
        """Router logits (N, E) -> (weights, experts), each (N, k): softmax in fp32, then the top k."""
        if self.routing.score == "sigmoid":
            return self._choose_by_sigmoid(logits)
        probs = torch.softmax(logits.float(), dim=-1)
        weights, chosen = torch.topk(probs, self.routing.top_k, dim=-1)
        if self.routing.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(logits.dtype), chosen

    def _choose_by_sigmoid(self, logits: Tensor) -> tuple[Tensor, Tensor]:
        r = self.routing
        scores = logits.float().sigmoid()  # (N, E)
        biased = scores + self.score_bias.float()
        if r.groups > 1:  # only the experts of the best topk_groups groups compete
            grouped = biased.view(len(biased), r.groups, -1)
            best = grouped.topk(min(2, grouped.size(-1)), dim=-1).values.sum(-1)  # (N, groups)
            keep = torch.zeros_like(best).scatter_(1, best.topk(r.topk_groups, dim=-1).indices, 1.0).bool()
            biased = biased.masked_fill(~keep.repeat_interleave(grouped.size(-1), dim=1), float("-inf"))
        chosen = biased.topk(r.top_k, dim=-1).indices
        weights = scores.gather(1, chosen)
        if r.norm_topk:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return (weights * r.scale).to(logits.dtype), chosen

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # (N, D)
        logits = self.router(flat)  # (N, E)
        weights, chosen = self.choose(logits)  # (N, k) each
        n, k = chosen.shape
        slots = chosen.flatten()  # (N k,) the expert of each (token, choice)
        if n == 1 and not torch.is_grad_enabled():  # decoding one token: its k experts, nothing to sort
            picked = slots.tolist()
            counts = torch.tensor([picked.count(e) for e in range(self.routing.n_experts)])
            order = sorted(range(k), key=picked.__getitem__)
            ys = self.experts(flat.expand(k, -1), counts.tolist())  # (k, D), by expert
            out = weights[0, order].to(flat.dtype)[None] @ ys  # (1, D)
        else:
            order = slots.argsort(stable=True)  # the slots grouped by expert
            counts = torch.bincount(slots, minlength=self.routing.n_experts)  # (E,)
            rows = order // k  # (N k,) the token of each grouped slot
            ys = self.experts(flat.index_select(0, rows), counts.tolist())  # (N k, D); its backward an index_add
            ys = ys * weights.flatten()[order, None]
            out = torch.zeros_like(flat).index_add_(0, rows, ys.to(flat.dtype))  # (N, D)
        if self.shared is not None:
            shared = self.shared(flat)
            out = out + (shared if self.shared_gate is None else torch.sigmoid(self.shared_gate(flat)) * shared)
        if self.training and torch.is_grad_enabled() and self.routing.score == "softmax":
            self.routed.append(logits)  # the balancing and z losses are a softmax router's
        if self.load is not None:
            self.load += counts.to(self.load.dtype)
        return out.view(shape)


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def balancing_loss(logits: list[Tensor], n_experts: int, top_k: int) -> Tensor:
    """Switch Transformer's load-balancing loss as transformers' load_balancing_loss_func computes it:
    over the router logits of every MoE layer (each (N, E)) taken as one set of rows, E times the dot
    product of the fraction of choices each expert received and its mean router probability (1.0 when
    perfectly balanced)."""
    rows = torch.cat([x.float() for x in logits])  # (layers N, E)
    probs = torch.softmax(rows, dim=-1)
    chosen = torch.topk(probs, top_k, dim=-1).indices  # (layers N, k)
    picked = torch.zeros(n_experts, device=rows.device).scatter_add_(
        0, chosen.flatten(), torch.ones(chosen.numel(), device=rows.device)
    )
    return (picked / rows.shape[0] * probs.mean(dim=0)).sum() * n_experts


def z_loss(logits: list[Tensor]) -> Tensor:
    """ST-MoE's router z-loss: the mean squared log-partition of the router logits (keeps them small)."""
    rows = torch.cat([x.float() for x in logits])
    return torch.logsumexp(rows, dim=-1).square().mean()


def routing_losses(layers: list[MoE]) -> tuple[Tensor | None, dict[str, Tensor]]:
    """The routers' share of the training loss (the weighted balancing and z losses) and their metrics,
    from the logits the layers kept in this pass (then forgotten); (None, {}) when no pass kept any."""
    logits = [x for layer in layers for x in layer.routed]
    for layer in layers:
        layer.routed = []
    if not logits:
        return None, {}
    routing = layers[0].routing
    aux = balancing_loss(logits, routing.n_experts, routing.top_k)
    metrics = {"router_aux": aux.detach()}
    loss = aux * routing.aux_coef
    if routing.z_coef:
        z = z_loss(logits)
        metrics["router_z"] = z.detach()
        loss = loss + z * routing.z_coef
    return loss, metrics


@contextlib.contextmanager
def expert_load(layers: list[MoE]):
    """Count the tokens each layer's experts receive inside the block: yields a list that holds, on
    leaving, one list of counts (E) per MoE layer."""
    counted: list[list[int]] = []
    for layer in layers:
        layer.load = torch.zeros(layer.routing.n_experts, device=layer.router.weight.device)
    try:
        yield counted
    finally:
        for layer in layers:
            counted.append([int(c) for c in layer.load.tolist()])
            layer.load = None


def imbalance(load: list[int]) -> float:
    """The busiest expert's tokens over the mean (1.0: balanced; E: one expert takes everything)."""
    total = sum(load)
    return max(load) * len(load) / total if total else 0.0
