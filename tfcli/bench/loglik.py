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


def _decoder_batch(model, batch: list[list[Request]], pad: int, device) -> list[list[tuple[float, bool]]]:
    """Right-padded rows of context + continuation (a shared row: the context, and its choices' one
    token each read from the last position); each row's continuation positions scored."""
    limit = model.cfg.max_seq_len
    texts = [(row[0].context + (row[0].continuation if len(row) == 1 else []))[-(limit + 1) :] for row in batch]
    inputs = [
        t[:-1] if len(row) == 1 else t[-limit:] for t, row in zip(texts, batch)
    ]  # a shared row scores after its end
    width = max(len(x) for x in inputs)
    ids = torch.full((len(inputs), width), pad, dtype=torch.long)
    for i, x in enumerate(inputs):
        ids[i, : len(x)] = torch.tensor(x)
    hidden = model(ids.to(device))  # (B, T, D); right padding: causal attention never reads it
    out = []
    for i, (x, row) in enumerate(zip(inputs, batch)):
        if len(row) == 1:
            n = len(row[0].continuation)
            logits = model.logits(hidden[i : i + 1, len(x) - n : len(x)])[0]  # (n, V): the positions predicting it
            out.append([_score(logits, row[0].continuation, device)])
        else:
            logits = model.logits(hidden[i : i + 1, len(x) - 1 : len(x)])[0]  # (1, V): the next token's distribution
            out.append([_score(logits, r.continuation, device) for r in row])
    return out


def _seq2seq_batch(model, rows: list[list[Request]], pad: int, device) -> list[list[tuple[float, bool]]]:
    """The context to the encoder, the continuation as the decoder's target (teacher forcing)."""
    batch = [row[0] for row in rows]
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
        [_score(model.logits(hidden[i : i + 1, : len(r.continuation)])[0], r.continuation, device)]
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
    does not fit in memory fails at once). A decoder's questions whose choices are one token each after
    one context run that context once (one row for all their choices)."""
    device = next(model.parameters()).device
    if kinds.is_seq2seq(model):
        rows, run = [[i] for i in range(len(requests))], _seq2seq_batch
    else:
        rows, run = _rows(requests), _decoder_batch
    rows.sort(key=lambda row: -(len(requests[row[0]].context) + len(requests[row[0]].continuation)))
    results: dict[int, Score] = {}
    for start in range(0, len(rows), batch_size):
        batch = rows[start : start + batch_size]
        scored = run(model, [[requests[i] for i in row] for row in batch], pad, device)
        for row, row_scores in zip(batch, scored):
            for i, (ll, greedy) in zip(row, row_scores):
                results[i] = Score(requests[i].question, requests[i].choice, ll, greedy)
        if progress is not None:
            progress(sum(len(row) for row in batch))
    return [results[i] for i in range(len(requests))]


def _rows(requests: list[Request]) -> list[list[int]]:
    """The requests a decoder row scores: a question's one-token choices after one context share a
    row; any other request has a row of its own."""
    by_question: dict[int, list[int]] = {}
    for i, r in enumerate(requests):
        by_question.setdefault(r.question, []).append(i)
    rows = []
    for members in by_question.values():
        first = requests[members[0]]
        if all(len(requests[i].continuation) == 1 and requests[i].context == first.context for i in members):
            rows.append(members)
        else:
            rows += [[i] for i in members]
    return rows
