"""The log-likelihood of each choice's continuation after its context, as lm-evaluation-harness's
`loglikelihood` requests compute it, for decoders and encoder-decoders.

Encoding follows lm-evaluation-harness's `_encode_pair`: the context's trailing whitespace moves to the
continuation, the whole text is encoded once, and the continuation's tokens are those after the
context's own encoding. A decoder reads context + continuation (cut on the left to its positions) and
only the continuation's positions go through the LM head; rows of one batch have similar lengths.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..errors import UserError
from ..models import kinds
from ..objectives.losses import shift_right


@dataclass(frozen=True)
class Request:
    """One choice of one question: the ids of its context and of its continuation."""

    question: int
    choice: int
    context: list[int]
    continuation: list[int]


@dataclass(frozen=True)
class Score:
    question: int
    choice: int
    loglikelihood: float  # the continuation's summed log-probability
    greedy: bool  # every continuation token is the model's most likely one


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer.encode(context + continuation)
    context_ids = tokenizer.encode(context)
    return context_ids, whole[len(context_ids) :]


def requests(tokenizer, questions, delimiter: str) -> list[Request]:
    """Every choice of every question, its continuation the delimiter and the choice's text."""
    out = []
    for q, question in enumerate(questions):
        for c, choice in enumerate(question.choices):
            context, continuation = encode_pair(tokenizer, question.context, delimiter + choice)
            if not continuation:
                raise UserError(f"question {q}: choice {c} encodes to no tokens")
            if not context:
                context = [tokenizer.eos_id if tokenizer.eos_id is not None else 0]  # lm-eval's prefix token
            out.append(Request(q, c, context, continuation))
    return out


def _decoder_batch(model, batch: list[Request], pad: int, device) -> list[tuple[float, bool]]:
    """Right-padded rows of context + continuation; each row's continuation positions scored."""
    limit = model.cfg.max_seq_len
    rows = [(r.context + r.continuation)[-(limit + 1) :][:-1] for r in batch]  # the inputs: all but the last token
    width = max(len(row) for row in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
    hidden = model(ids.to(device))  # (B, T, D); right padding: causal attention never reads it
    out = []
    for i, (row, r) in enumerate(zip(rows, batch)):
        n = len(r.continuation)
        scored = hidden[i, len(row) - n : len(row)]  # (n, D): the positions that predict the continuation
        out.append(_score(model.logits(scored[None])[0], r.continuation, device))
    return out


def _seq2seq_batch(model, batch: list[Request], pad: int, device) -> list[tuple[float, bool]]:
    """The context to the encoder, the continuation as the decoder's target (teacher forcing)."""
    enc_width, dec_width = max(len(r.context) for r in batch), max(len(r.continuation) for r in batch)
    ids = torch.full((len(batch), enc_width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full((len(batch), dec_width), pad, dtype=torch.long)
    for i, r in enumerate(batch):
        ids[i, : len(r.context)], mask[i, : len(r.context)] = torch.tensor(r.context), 1
        labels[i, : len(r.continuation)] = torch.tensor(r.continuation)
    ids, mask, labels = ids.to(device), mask.to(device), labels.to(device)
    hidden = model.decode(shift_right(labels, pad), model.encode(ids, mask), mask)  # (B, T, D)
    return [
        _score(model.logits(hidden[i : i + 1, : len(r.continuation)])[0], r.continuation, device)
        for i, r in enumerate(batch)
    ]


def _score(logits: Tensor, continuation: list[int], device) -> tuple[float, bool]:
    """(n, vocab) logits of the positions predicting the continuation's n tokens -> (summed
    log-probability, whether each token is the argmax)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    target = torch.tensor(continuation, device=device)
    return float(logp.gather(1, target[:, None]).sum()), bool((logp.argmax(-1) == target).all())


@torch.no_grad()
def score(model, requests: list[Request], pad: int, batch_size: int, progress=None) -> list[Score]:
    """Every request's log-likelihood, in batches of similar lengths (longest first, so a batch that
    does not fit in memory fails at once)."""
    device = next(model.parameters()).device
    run = _seq2seq_batch if kinds.is_seq2seq(model) else _decoder_batch
    order = sorted(range(len(requests)), key=lambda i: -(len(requests[i].context) + len(requests[i].continuation)))
    results: dict[int, Score] = {}
    for start in range(0, len(order), batch_size):
        batch = [requests[i] for i in order[start : start + batch_size]]
        for i, (ll, greedy) in zip(order[start : start + batch_size], run(model, batch, pad, device)):
            results[i] = Score(requests[i].question, requests[i].choice, ll, greedy)
        if progress is not None:
            progress(len(batch))
    return [results[i] for i in range(len(requests))]
