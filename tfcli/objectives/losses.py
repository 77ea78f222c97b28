"""Cross-entropy through a (large-vocabulary) output projection without materialising all logits.

Training a small model on a 50k vocabulary spends most of its time and memory on the
(tokens x vocab) logits. `linear_cross_entropy` walks the rows in chunks and, while the chunk's
logits are at hand, computes the loss and both gradients (softmax - one-hot), so the full logits
tensor, its log-softmax and their backward passes never exist. Same FLOPs, far less memory traffic.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor, nn

from ..data import IGNORE  # noqa: F401  (the objectives import it from here too)
from ..engine.compiling import eager


def _chunk_rows(vocab: int) -> int:
    return max(64, (1 << 25) // max(vocab, 1))  # about 128 MB of fp32 logits per chunk


_cpu_chunk = {"logits": torch.empty(0)}  # grown to the largest chunk used, then kept (at most ~128 MB)


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


def _capped(logits: Tensor, softcap: float) -> Tensor | None:
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
    """softmax(cap(h @ weight.T) / temperature) in fp32, (c, V), and the cap's slope (see _capped). On the CPU every
    chunk of every call is written into one reused buffer of `rows` x V, softmaxed in place: the
    allocator hands out a fresh 100+ MB tensor as new pages from the OS, and faulting them in costs
    about half as much as the softmax itself (docs/results/measured.md). CUDA's caching allocator
    reuses memory already. The buffer stays allocated for the process's life, once it has trained or
    evaluated."""
    c, v = h.size(0), weight.size(0)
    if h.device.type != "cpu" or h.dtype != torch.float32 or weight.dtype != torch.float32:
        logits = (h @ weight.t()).float()
        slope = _capped(logits, softcap)
        return torch.softmax(logits.div_(temperature) if temperature != 1.0 else logits, dim=-1), slope
    buf = _cpu_chunk["logits"]
    if buf.numel() < c * v:  # as large as the chunks have needed (a few targets need no 128 MB)
        buf = _cpu_chunk["logits"] = torch.empty(c * v)
    logits = torch.mm(h, weight.t(), out=buf[: c * v].view(c, v))  # (c, V)
    slope = _capped(logits, softcap)
    if temperature != 1.0:
        logits.div_(temperature)
    logits.sub_(logits.amax(-1, keepdim=True)).exp_()
    return logits.div_(logits.sum(-1, keepdim=True)), slope


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
        step = _chunk_rows(v)
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
    return _LinearCrossEntropy.apply(
        h, weight, t, grad and hidden.requires_grad, grad and weight.requires_grad, with_accuracy, softcap
    )


class _LinearTokenLogProbs(torch.autograd.Function):
    """log softmax(hidden @ weight.T)[target] per row, in chunks of rows: the logits of a chunk exist
    only while it is computed, forward and again in backward (recomputed: memory over FLOPs)."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, targets: Tensor, softcap: float, temperature: float):
        # hidden (N, D), weight (V, D), targets (N,) with IGNORE where a row has no target
        out = torch.zeros(hidden.size(0), dtype=torch.float32, device=hidden.device)
        safe = targets.clamp(min=0)
        step = _chunk_rows(weight.size(0))
        for s in range(0, hidden.size(0), step):
            logits = (hidden[s : s + step] @ weight.t()).float()  # (c, V)
            if _capped(logits, softcap) is not None and temperature != 1.0:
                logits.div_(temperature)
            # log p = x_t - max - log sum exp(x - max), as torch.logsumexp computes it, but in place:
            # logsumexp allocates a hidden (c, V) temporary that no tensor count (the memory plan) sees
            logits.sub_(logits.amax(-1, keepdim=True))
            picked = logits.gather(1, safe[s : s + step, None]).squeeze(1)  # (c,) x_t - max
            out[s : s + step] = picked - logits.exp_().sum(-1).log()
        out.masked_fill_(targets == IGNORE, 0.0)
        ctx.save_for_backward(hidden, weight, targets)
        ctx.softcap, ctx.temperature = softcap, temperature
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        hidden, weight, targets = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        safe, valid = targets.clamp(min=0), targets != IGNORE
        step = _chunk_rows(weight.size(0))
        for s in range(0, hidden.size(0), step):
            h = hidden[s : s + step]
            g, slope = _chunk_probs(h, weight, step, ctx.softcap, ctx.temperature)
            g = g.neg_()  # (c, V): d logp / d logits = onehot - p
            g[torch.arange(len(h), device=h.device), safe[s : s + step]] += 1.0
            g *= (grad_out[s : s + step] * valid[s : s + step])[:, None]
            if slope is not None:
                g.mul_(slope).div_(ctx.temperature)  # through the temperature and the cap
            if grad_hidden is not None:
                grad_hidden[s : s + step] = (g.to(weight.dtype) @ weight).to(hidden.dtype)
            if grad_weight is not None:
                grad_weight.addmm_(g.t(), h.float())
        return grad_hidden, grad_weight.to(weight.dtype) if grad_weight is not None else None, None, None, None


@eager
def token_logprobs(
    hidden: Tensor, weight: Tensor, targets: Tensor, softcap: float = 0.0, temperature: float = 1.0
) -> Tensor:
    """(B, T) the log-probability of each position's target under softmax(cap(hidden @ weight.T) /
    temperature), 0 where the target is IGNORE (prompt, padding): what on-policy losses weigh token by
    token (GRPO's log pi(o_t | q, o_<t)). hidden (B, T, D), weight (V, D), targets (B, T). Only the
    positions with a target reach the head, and no (B, T, V) logits are kept."""
    if not softcap and temperature != 1.0:  # uncapped logits scale with the hidden states
        hidden, temperature = hidden / temperature, 1.0
    b, t = targets.shape
    rows = (targets.reshape(-1) != IGNORE).nonzero().squeeze(1)  # (N,) the positions with a target
    picked = hidden.reshape(b * t, -1)[rows]  # (N, D)
    token = _LinearTokenLogProbs.apply(picked, weight, targets.reshape(-1)[rows], softcap, temperature)  # (N,)
    return token.new_zeros(b * t).index_add(0, rows, token).view(b, t)


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
