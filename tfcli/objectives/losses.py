"""Cross-entropy through a (large-vocabulary) output projection without materialising all logits.

Training a small model on a 50k vocabulary spends most of its time and memory on the
(tokens x vocab) logits. Two ways through them, neither holding more than a tile of logits:

- a head that trains (its weight gradient wanted): the rows in chunks; while a chunk's logits are at
  hand the loss and both gradients (softmax - one-hot) come from them, three products a chunk;
- a frozen head (LoRA, QLoRA, IA3, a probe), an evaluation, the token log-probabilities: every row at
  once against the vocabulary in tiles, with an online log-sum-exp (Cut Cross-Entropy's and Liger's
  fused linear cross-entropy's way; the hidden states' gradient accumulated as flash attention
  accumulates its output, rescaled as the running maximum moves). Each product then has all the rows
  and a few thousand columns: on a 2-core EPYC, [512 x 640] @ [640 x 8192] tiles run the 262k
  vocabulary's products 1.2-1.5x faster than 128-row chunks do (docs/results/measured.md).

Same FLOPs, far less memory traffic than the full logits, their log-softmax and their backward passes.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor, nn

from ..data import IGNORE  # noqa: F401  (the objectives import it from here too)
from ..engine.compiling import eager
from ..engine.scratch import releases_after_probes, repeated_ops

CHUNK_ELEMENTS = 1 << 25  # a trained head's chunk of logits: 128 MB of fp32 ...
EFFICIENT_ROWS = 512  # ... or this many rows, where more: the rows a product needs to run at the
# machine's speed (on a 2-core EPYC, [128 x 640] @ [640 x 262,144] runs 25% slower a row than 512 rows,
# 256 rows 8%; 512 is within 3% of 1,024: docs/results/measured.md)


def _chunk_rows(vocab: int, rows: int = 0) -> int:
    """Rows of a trained head's chunk of logits: CHUNK_ELEMENTS' worth, at least EFFICIENT_ROWS (a
    262k vocabulary's chunk is then 512 MB), and for `rows` rows in all the chunks of equal size (no
    short last chunk). Fewer rows a step (micro-batches, which the memory plan chooses when a run does
    not fit its limit) make smaller chunks."""
    most = max(EFFICIENT_ROWS, CHUNK_ELEMENTS // max(vocab, 1))
    if rows <= most:
        return max(rows, 1)
    return -(-rows // -(-rows // most))


TILE_ELEMENTS = 1 << 22  # a tile's logits: 16 MB of fp32 (512 rows x 8,192 columns, 4,096 x 1,024)
ROW_BLOCK = 4096  # rows a tile takes at most: more rows, more blocks (each its own online softmax)
MIN_COLUMNS = 1024  # a tile narrower than this runs its products at a fraction of the machine's speed


def _tile(rows: int, vocab: int, device: torch.device | None = None) -> tuple[int, int]:
    """(rows, vocabulary columns) of one tile of logits: every row up to ROW_BLOCK, as many columns as
    TILE_ELEMENTS leaves them, at least MIN_COLUMNS. On a GPU a tile is a chunk's 128 MB: each tile is
    a few kernel launches, which the host pays for (not measured there yet)."""
    elements = CHUNK_ELEMENTS if device is not None and device.type == "cuda" else TILE_ELEMENTS
    r = max(1, min(rows, ROW_BLOCK))
    return r, max(1, min(vocab, max(MIN_COLUMNS, elements // r)))


_cpu_chunk = {"logits": torch.empty(0)}  # grown to the largest chunk or tile used; kept up to
# CHUNK_ELEMENTS (128 MB of fp32) between calls, larger given back once the call's chunks are done;
# others (distillation's) are reused across one call's chunks and given back after it (give_back)


@releases_after_probes
def release_buffers() -> None:
    """Give the reused buffers of logits back (the memory plan, once its probes have run)."""
    for name in _cpu_chunk:
        _cpu_chunk[name] = torch.empty(0)


def _keep_at_most(elements: int) -> None:
    """Give the reused buffer back where it outgrew `elements`: a 262k vocabulary's 512-row chunk is
    512 MB, which would otherwise stay held through the backward pass and the optimizer's step, the
    step's peak (faulting it in afresh costs ~0.15 s a step on a 2-core EPYC, 2% of a Gemma-3-270M
    step: docs/results/measured.md)."""
    if _cpu_chunk["logits"].numel() > elements:
        _cpu_chunk["logits"] = torch.empty(0)


def reused(name: str, rows: int, columns: int) -> Tensor:
    """(rows, columns) of fp32 in the CPU buffer `name`, grown to the largest asked for and kept
    until given back: a fresh 100+ MB tensor comes as new pages from the OS, and faulting them in
    costs about half as much as a softmax over them (docs/results/measured.md)."""
    buf = _cpu_chunk.get(name, torch.empty(0))
    if buf.numel() < rows * columns:
        buf = _cpu_chunk[name] = torch.empty(rows * columns)
    return buf[: rows * columns].view(rows, columns)


def give_back(*names: str) -> None:
    """Release the reused buffers `names` (a loss's, once its chunks are done)."""
    for name in names:
        _cpu_chunk.pop(name, None)


def _reusable(*tensors: Tensor) -> bool:
    """Whether a result of these goes into a reused buffer: fp32 on the CPU (CUDA's caching allocator
    reuses memory already)."""
    return all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)


def scratch_logits(h: Tensor, w: Tensor, name: str = "logits") -> Tensor:
    """h @ w.T in fp32: into the reused buffer `name` where _reusable, else a new tensor."""
    if not _reusable(h, w):
        return (h @ w.t()).float()
    return torch.mm(h, w.t(), out=reused(name, h.size(0), w.size(0)))


def scratch_like(x: Tensor, name: str) -> Tensor:
    """An uninitialised tensor of x's shape: the reused buffer `name` where _reusable, else a new one."""
    return reused(name, *x.shape) if _reusable(x) else torch.empty_like(x)


class LMHead(NamedTuple):
    """What the fused losses read of a decoder's output layer: the hidden states as the head takes them
    (scaled by the model's logit multiplier, Granite's), its weight (V, D), and the soft cap of its
    logits (Gemma 2's; 0: none)."""

    hidden: Tensor
    weight: Tensor
    softcap: float = 0.0


def lm_head(model: nn.Module, hidden: Tensor) -> LMHead:
    """The LM head of `model` applied to `hidden`, as LMHead: what a model with no multiplier or cap is
    asked for is only its lm_head_weight."""
    scale, cap = getattr(model, "logit_scale", 1.0), getattr(model, "logit_softcap", 0.0)
    return LMHead(hidden * scale if scale != 1.0 else hidden, model.lm_head_weight, cap)


def capped_in_place(logits: Tensor, softcap: float) -> Tensor | None:
    """cap * tanh(logits / cap), in place, returning d capped / d logits = 1 - tanh^2 ((c, V); None
    without a cap)."""
    if not softcap:
        return None
    t = logits.div_(softcap).tanh_()
    slope = 1.0 - t * t
    t.mul_(softcap)
    return slope


def _chunk_probs(
    h: Tensor, weight: Tensor, rows: int, softcap: float = 0.0, temperature: float = 1.0
) -> tuple[Tensor, Tensor | None]:
    """softmax(cap(h @ weight.T) / temperature) in fp32, (c, V), and the cap's slope (see
    capped_in_place). On the CPU every chunk of every call is written into one reused buffer of
    `rows` x V, softmaxed in place: the
    allocator hands out a fresh 100+ MB tensor as new pages from the OS, and faulting them in costs
    about half as much as the softmax itself (docs/results/measured.md). CUDA's caching allocator
    reuses memory already. The buffer stays allocated for the process's life, once it has trained or
    evaluated."""
    if not _reusable(h, weight):
        logits = (h @ weight.t()).float()
        slope = capped_in_place(logits, softcap)
        return torch.softmax(logits.div_(temperature) if temperature != 1.0 else logits, dim=-1), slope
    logits = scratch_logits(h, weight)  # (c, V), as large as the chunks have needed
    slope = capped_in_place(logits, softcap)
    if temperature != 1.0:
        logits.div_(temperature)
    logits.sub_(logits.amax(-1, keepdim=True)).exp_()
    return logits.div_(logits.sum(-1, keepdim=True)), slope


class _Online(NamedTuple):
    """What one pass over the vocabulary's tiles leaves per row: the log-sum-exp of the (capped,
    tempered) logits, the target's logit, the cap's slope there, and (asked for) the argmax,
    sum_v softmax_v * slope_v * w_v (the hidden state's gradient, but for its target's term), and the
    softmax's entropy and the logits' mean over the vocabulary (what TRL's DPO logs)."""

    lse: Tensor
    target: Tensor
    target_slope: Tensor | None
    argmax: Tensor | None
    numerator: Tensor | None
    entropy: Tensor | None = None
    mean_logit: Tensor | None = None


class _Running:
    """One row block's running state over the vocabulary's tiles: the maximum logit, the sum of
    exponentials below it, the target's logit and the cap's slope there, the argmax, the gradient's
    numerator sum_v exp(x_v - max) slope_v w_v, and for the moments sum_v exp(x_v - max)(x_v - max)
    and sum_v x_v, each moved on tile by tile (Milakov and Gimelshein's online softmax; the numerator
    rescaled as flash attention rescales its output)."""

    def __init__(self, h: Tensor, softcap: float, numerator: bool, argmax: bool, moments: bool = False):
        n, f32 = h.size(0), dict(dtype=torch.float32, device=h.device)
        self.dtype = h.dtype
        self.max = torch.full((n,), float("-inf"), **f32)
        self.total, self.target = torch.zeros(n, **f32), torch.zeros(n, **f32)
        self.target_slope = torch.ones(n, **f32) if softcap else None
        self.best = torch.full((n,), float("-inf"), **f32) if argmax else None
        self.best_at = torch.zeros(n, dtype=torch.long, device=h.device) if argmax else None
        self.numerator = torch.zeros(n, h.size(1), **f32) if numerator else None
        self.weighted = torch.zeros(n, **f32) if moments else None  # sum_v exp(x_v - max)(x_v - max)
        self.logit_sum = torch.zeros(n, **f32) if moments else None
        self.columns = 0

    def add(self, logits: Tensor, slope: Tensor | None, w: Tensor, first: int, safe: Tensor) -> None:
        """One tile: `logits` (n, c) of the vocabulary's columns from `first` on (consumed in place),
        `w` their rows of the weight, `safe` the targets."""
        local = safe - first
        hit = (local >= 0) & (local < w.size(0))
        at = local.clamp(0, w.size(0) - 1)[:, None]
        self.target = torch.where(hit, logits.gather(1, at).squeeze(1), self.target)
        if self.target_slope is not None:
            self.target_slope = torch.where(hit, slope.gather(1, at).squeeze(1), self.target_slope)
        if self.best is not None:
            top, where = logits.max(1)
            better = top > self.best
            self.best, self.best_at = (
                torch.where(better, top, self.best),
                torch.where(better, where + first, self.best_at),
            )
        peak = torch.maximum(self.max, logits.amax(1))
        scale = (self.max - peak).exp_()  # the running sums at the new maximum (exp(-inf) = 0 at first)
        if self.weighted is not None:
            self.logit_sum.add_(logits.sum(1))
            self.columns += logits.size(1)
            shift = torch.where(self.total > 0, self.max - peak, 0.0)  # (on the first tile the sums are 0)
            self.weighted.add_(self.total * shift).mul_(scale)
        shifted = logits.sub_(peak[:, None])
        before = shifted.clone() if self.weighted is not None else None
        probs = shifted.exp_()  # exp(x - max), in place
        if before is not None:
            self.weighted.add_((probs * before).sum(1))
        self.total.mul_(scale).add_(probs.sum(1))
        self.max = peak
        if self.numerator is not None:
            if slope is not None:
                probs.mul_(slope)
            self.numerator.mul_(scale[:, None])
            if probs.dtype == w.dtype == torch.float32:
                self.numerator.addmm_(probs, w)
            else:
                self.numerator.add_(torch.mm(probs.to(self.dtype), w.to(self.dtype)).float())

    def result(self) -> _Online:
        gradient = self.numerator / self.total[:, None] if self.numerator is not None else None
        moments = (None, None)
        if self.weighted is not None:  # H = lse - E_p[x] = log(total) - sum exp(x - max)(x - max) / total
            moments = (self.total.log() - self.weighted / self.total, self.logit_sum / self.columns)
        return _Online(self.max + self.total.log(), self.target, self.target_slope, self.best_at, gradient, *moments)


def _online_pass(
    h: Tensor,
    weight: Tensor,
    safe: Tensor,
    softcap: float,
    temperature: float,
    numerator: bool,
    argmax: bool,
    moments: bool = False,
) -> _Online:
    """One row block against every vocabulary tile (see the module's docstring); nothing of the
    vocabulary's width outlives its tile."""
    state = _Running(h, softcap, numerator, argmax, moments)
    cols = _tile(h.size(0), weight.size(0), h.device)[1]
    with repeated_ops():
        for first in range(0, weight.size(0), cols):
            w = weight[first : first + cols]
            logits = scratch_logits(h, w)  # (n, c)
            slope = capped_in_place(logits, softcap)
            if temperature != 1.0:
                logits.div_(temperature)
            state.add(logits, slope, w, first, safe)
    return state.result()


def _online(hidden: Tensor, weight: Tensor, safe: Tensor, softcap: float, temperature: float, **asked) -> _Online:
    """_online_pass over blocks of at most ROW_BLOCK rows (each row's softmax is its own), joined;
    `asked`: its numerator, argmax and moments."""
    rows = _tile(hidden.size(0), weight.size(0), hidden.device)[0]
    if hidden.size(0) <= rows:
        return _online_pass(hidden, weight, safe, softcap, temperature, **asked)
    parts = [
        _online_pass(hidden[s : s + rows], weight, safe[s : s + rows], softcap, temperature, **asked)
        for s in range(0, hidden.size(0), rows)
    ]
    return _Online(*(None if p[0] is None else torch.cat(p) for p in zip(*parts)))


class _FrozenHeadCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy and the hidden states' gradient for a head whose weight does not train, in one
    online pass over the vocabulary's tiles (two products a tile, every row in each)."""

    @staticmethod
    def forward(
        ctx, hidden: Tensor, weight: Tensor, targets: Tensor, grad_needed: bool, with_accuracy: bool, softcap: float
    ):
        valid = targets != IGNORE
        n_valid = valid.sum().clamp(min=1)
        safe = targets.clamp(min=0)
        if hidden.size(0) == 0:
            ctx.save_for_backward(torch.zeros_like(hidden) if grad_needed else None)
            zero = torch.zeros((), dtype=torch.long, device=hidden.device)
            ctx.mark_non_differentiable(zero)
            return hidden.new_zeros((), dtype=torch.float32), zero
        out = _online(hidden, weight, safe, softcap, 1.0, numerator=grad_needed, argmax=with_accuracy)
        loss = ((out.lse - out.target) * valid).sum() / n_valid
        correct = (
            ((out.argmax == safe) & valid).sum()
            if with_accuracy
            else torch.zeros((), dtype=torch.long, device=hidden.device)
        )
        grad_hidden = None
        if grad_needed:  # d loss / d h = (sum_v p_v slope_v w_v - slope_t w_t) / n_valid, ignored rows 0
            picked = weight[safe].float()
            if out.target_slope is not None:
                picked.mul_(out.target_slope[:, None])
            grad_hidden = out.numerator.sub_(picked).mul_((valid.float() / n_valid)[:, None]).to(hidden.dtype)
        ctx.save_for_backward(grad_hidden)
        ctx.mark_non_differentiable(correct)
        return loss, correct

    @staticmethod
    def backward(ctx, grad_loss: Tensor, _grad_correct):
        (grad_hidden,) = ctx.saved_tensors
        return (
            (None if grad_hidden is None else grad_hidden.mul_(grad_loss.to(grad_hidden.dtype))),
            None,
            None,
            None,
            None,
            None,
        )


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        hidden: Tensor,
        weight: Tensor,
        targets: Tensor,
        grad_hidden_needed: bool,
        grad_weight_needed: bool,
        with_accuracy: bool,
        softcap: float,
    ):
        # hidden (N, D), weight (V, D), targets (N,) with IGNORE for positions without a loss.
        # A frozen head (LoRA, a probe) gets no weight gradient: a third of the head's FLOPs saved
        n, v = hidden.size(0), weight.size(0)
        valid = targets != IGNORE
        n_valid = valid.sum().clamp(min=1)
        safe = targets.clamp(min=0)
        loss_sum = hidden.new_zeros((), dtype=torch.float32)
        correct = torch.zeros((), dtype=torch.long, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if grad_hidden_needed else None
        # written by the first chunk's product, accumulated by the rest: a zero fill first would be one
        # more pass over (and, fresh, a page fault for) every weight of the output layer
        grad_weight = torch.empty_like(weight, dtype=torch.float32) if grad_weight_needed else None
        step = _chunk_rows(v, n)
        for s in range(0, n, step):
            h = hidden[s : s + step]
            t, ok = safe[s : s + step], valid[s : s + step]
            probs, slope = _chunk_probs(h, weight, step, softcap)  # (c, V)
            if with_accuracy:
                correct += ((probs.argmax(-1) == t) & ok).sum()
            p_target = probs.gather(1, t[:, None]).squeeze(1)
            loss_sum -= (p_target.clamp_min(1e-38).log() * ok).sum()
            if grad_hidden_needed or grad_weight_needed:
                probs[torch.arange(len(t), device=t.device), t] -= 1.0  # d loss / d logits, unscaled
                if slope is not None:
                    probs.mul_(slope)  # through the cap
                # each row's weight (1/n_valid, or 0 where ignored) goes on the narrow (c, D) side
                # of the two products, saving a pass over the (c, V) chunk
                row = (ok.float() / n_valid)[:, None]  # (c, 1)
                g = probs.to(hidden.dtype)
                if grad_hidden_needed:
                    torch.mm(g, weight.to(hidden.dtype), out=grad_hidden[s : s + step]).mul_(row.to(hidden.dtype))
                if grad_weight_needed:  # beta 0: the first chunk writes it, what the buffer held is ignored
                    grad_weight.addmm_(g.t().float(), h.float() * row, beta=float(s > 0))
        if grad_weight_needed and n == 0:
            grad_weight.zero_()  # no rows, no chunk wrote it
        _keep_at_most(CHUNK_ELEMENTS)
        ctx.save_for_backward(grad_hidden, grad_weight.to(weight.dtype) if grad_weight_needed else None)
        ctx.mark_non_differentiable(correct)
        return loss_sum / n_valid, correct

    @staticmethod
    def backward(ctx, grad_loss: Tensor, _grad_correct):
        grad_hidden, grad_weight = ctx.saved_tensors
        # in place: the gradients are this function's own buffers, read once; a new (V, D) product
        # would fault in fresh pages for every weight of the output layer (1.3 s of a Gemma-3-270M
        # step, whose 262,144 x 640 output layer is most of its weights)
        scaled = lambda g: None if g is None else g.mul_(grad_loss.to(g.dtype))  # noqa: E731
        return scaled(grad_hidden), scaled(grad_weight), None, None, None, None, None


@eager
def linear_cross_entropy(
    hidden: Tensor, weight: Tensor, targets: Tensor, with_accuracy: bool = False, softcap: float = 0.0
) -> tuple[Tensor, Tensor]:
    """Mean cross-entropy of softmax(hidden @ weight.T) against targets, and the number of argmax
    hits (0 unless with_accuracy: it costs a pass over the logits). hidden (..., D), weight (V, D),
    targets (...) with -100 marking ignored positions; softcap: the logits capped first (LMHead).

    Kept out of torch.compile's graph (the model before it compiles; this runs eagerly): dynamo
    cannot trace the chunk loop's in-place gradient accumulation inside an autograd.Function
    ("an intermediate tensor ... aliases an input or output"), and the chunks are already a few
    large matmuls that compiling would not speed up."""
    h = hidden.reshape(-1, hidden.size(-1))
    t = targets.reshape(-1)
    grad = torch.is_grad_enabled()
    if not (grad and weight.requires_grad):  # a frozen head or no gradient: the vocabulary in tiles
        return _FrozenHeadCrossEntropy.apply(h, weight, t, grad and hidden.requires_grad, with_accuracy, softcap)
    return _LinearCrossEntropy.apply(h, weight, t, hidden.requires_grad, True, with_accuracy, softcap)


class _LinearTokenLogProbs(torch.autograd.Function):
    """log softmax(hidden @ weight.T)[target] per row: forward, one online pass over the vocabulary's
    tiles (the rows' log-sum-exp kept); backward, the tiles again (recomputed: memory over FLOPs), each
    tile's share of the weight's gradient written once and the hidden states' added up."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, targets: Tensor, softcap: float, temperature: float, stats: bool):
        # hidden (N, D), weight (V, D), targets (N,) with IGNORE where a row has no target; with `stats`
        # also each row's entropy, mean logit and argmax (empty tensors without), which take no gradient
        safe = targets.clamp(min=0)
        none = torch.zeros(0, dtype=torch.float32, device=hidden.device)
        entropy = mean_logit = argmax = none
        if hidden.size(0):
            out = _online(hidden, weight, safe, softcap, temperature, numerator=False, argmax=stats, moments=stats)
            logp, lse = out.target - out.lse, out.lse
            if stats:
                entropy, mean_logit, argmax = out.entropy, out.mean_logit, out.argmax
        else:
            logp = lse = none
            if stats:
                argmax = torch.zeros(0, dtype=torch.long, device=hidden.device)
        logp = logp.masked_fill(targets == IGNORE, 0.0)
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.softcap, ctx.temperature = softcap, temperature
        ctx.mark_non_differentiable(entropy, mean_logit, argmax)
        return logp, entropy, mean_logit, argmax

    @staticmethod
    def backward(ctx, grad_out: Tensor, *_stats):
        hidden, weight, targets, lse = ctx.saved_tensors
        n = hidden.size(0)
        grad_hidden = (
            torch.zeros(n, hidden.size(1), dtype=torch.float32, device=hidden.device)
            if ctx.needs_input_grad[0]
            else None
        )
        grad_weight = torch.empty_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        safe, row = targets.clamp(min=0), grad_out * (targets != IGNORE)  # (N,) each row's upstream gradient
        with repeated_ops():
            _tiled_backward(hidden, weight, safe, row, lse, ctx.softcap, ctx.temperature, grad_hidden, grad_weight)
        if grad_weight is not None and n == 0:
            grad_weight.zero_()
        return (
            grad_hidden.to(hidden.dtype) if grad_hidden is not None else None,
            grad_weight.to(weight.dtype) if grad_weight is not None else None,
            None,
            None,
            None,
            None,
        )


def _tiled_backward(hidden, weight, safe, row, lse, softcap, temperature, grad_hidden, grad_weight) -> None:
    """The token log-probabilities' gradients, tile by tile: each row's upstream gradient `row` times
    (onehot - softmax) through the cap and the temperature, into grad_hidden (added up over the
    vocabulary) and grad_weight (each tile's rows written by the first row block, added to after)."""
    n, v = hidden.size(0), weight.size(0)
    rows, cols = _tile(n, v, hidden.device)
    for s in range(0, n, rows):
        h, t, g_row, m = hidden[s : s + rows], safe[s : s + rows], row[s : s + rows], lse[s : s + rows]
        for first in range(0, v, cols):
            w = weight[first : first + cols]
            logits = scratch_logits(h, w)
            slope = capped_in_place(logits, softcap)
            if temperature != 1.0:
                logits.div_(temperature)
            g = logits.sub_(m[:, None]).exp_().neg_()  # d logp / d logits = onehot - p
            local = t - first
            hit = ((local >= 0) & (local < w.size(0))).float()
            g.scatter_add_(1, local.clamp(0, w.size(0) - 1)[:, None], hit[:, None])
            g.mul_(g_row[:, None])
            if slope is not None:
                g.mul_(slope)
            if temperature != 1.0:
                g.div_(temperature)
            if grad_hidden is not None:
                grad_hidden[s : s + rows].add_(torch.mm(g.to(weight.dtype), w).float())
            if grad_weight is not None:
                part = torch.mm(g.t(), h.float())
                if s == 0:
                    grad_weight[first : first + cols] = part
                else:
                    grad_weight[first : first + cols] += part


class TokenStats(NamedTuple):
    """Per trained position (B, T), 0 elsewhere, without gradient: the model's next-token entropy,
    its logits' mean over the vocabulary, and whether the target is its argmax (TRL's DPO metrics)."""

    entropy: Tensor
    mean_logit: Tensor
    is_top1: Tensor


@eager
def token_logprobs(
    hidden: Tensor, weight: Tensor, targets: Tensor, softcap: float = 0.0, temperature: float = 1.0, stats: bool = False
) -> Tensor | tuple[Tensor, TokenStats]:
    """(B, T) the log-probability of each position's target under softmax(cap(hidden @ weight.T) /
    temperature), 0 where the target is IGNORE (prompt, padding): what on-policy losses weigh token by
    token (GRPO's log pi(o_t | q, o_<t)). hidden (B, T, D), weight (V, D), targets (B, T). Only the
    positions with a target reach the head, and no (B, T, V) logits are kept. With `stats`, also
    TokenStats, from the same pass over the vocabulary."""
    if not softcap and temperature != 1.0:  # uncapped logits scale with the hidden states
        hidden, temperature = hidden / temperature, 1.0
    b, t = targets.shape
    flat = targets.reshape(-1)
    rows = (flat != IGNORE).nonzero().squeeze(1)  # (N,) the positions with a target
    picked = hidden.reshape(b * t, -1)[rows]  # (N, D)
    token, entropy, mean_logit, top = _LinearTokenLogProbs.apply(
        picked, weight, flat[rows], softcap, temperature, stats
    )  # (N,) each
    spread = lambda x: x.new_zeros(b * t).index_add(0, rows, x).view(b, t)  # noqa: E731
    if not stats:
        return spread(token)
    return spread(token), TokenStats(spread(entropy), spread(mean_logit), spread((top == flat[rows]).float()))


def sequence_logprobs(hidden: Tensor, weight: Tensor, targets: Tensor, softcap: float = 0.0) -> Tensor:
    """(B,) the summed log-probability of each sequence's targets (token_logprobs over its positions):
    what preference losses compare (DPO's log pi(y|x))."""
    return token_logprobs(hidden, weight, targets, softcap).sum(1)


# --- the losses of the text objectives, which text-to-text tasks (SFT, classification as text) train too


def next_token_loss(
    model: nn.Module, heads: nn.ModuleDict, batch: dict[str, Tensor]
) -> tuple[Tensor, dict[str, Tensor]]:
    """Mean next-token cross-entropy; `targets` are the inputs shifted left by one (IGNORE where a
    packed block crosses into the next document, with data.document_mask)."""
    hidden = model(batch["input_ids"], doc_ids=batch.get("doc_ids"))  # (B, T, D)
    head = lm_head(model, hidden)
    value, _ = linear_cross_entropy(head.hidden, head.weight, batch["targets"], softcap=head.softcap)
    return value, {"loss": value.detach()}


def with_perplexity(metrics: dict[str, float]) -> dict[str, float]:
    return {**metrics, "ppl": math.exp(min(metrics["loss"], 50.0))}


def shift_right(labels: Tensor, start_id: int) -> Tensor:
    """(B, T) targets -> decoder inputs: start token, then the targets up to T-1 (ignored ones as start)."""
    shifted = labels.new_full(labels.shape, start_id)
    shifted[:, 1:] = labels[:, :-1]
    return shifted.masked_fill(shifted == IGNORE, start_id)


def seq2seq_loss(model: nn.Module, heads: nn.ModuleDict, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
    """Cross-entropy of the targets given the noised input (teacher forcing); token accuracy.

    Padding costs nothing it need not: decoder positions after every row's last target are cut
    (causal attention: they cannot change earlier positions), and padded targets never reach the
    (large) output projection."""
    mask, labels = batch.get("attention_mask"), batch["labels"]
    valid = labels != IGNORE  # (B, T)
    last = int(valid.any(0).nonzero().max()) + 1 if bool(valid.any()) else 1
    labels, valid = labels[:, :last], valid[:, :last]
    hidden = model.decode(batch["decoder_input_ids"][:, :last], model.encode(batch["input_ids"], mask), mask)
    head = lm_head(model, hidden[valid])
    value, correct = linear_cross_entropy(
        head.hidden, head.weight, labels[valid], with_accuracy=True, softcap=head.softcap
    )
    return value, {"loss": value.detach(), "token_acc": correct.float() / valid.sum().clamp(min=1)}
