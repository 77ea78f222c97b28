"""The log-likelihood of each choice's continuation after its context, as lm-evaluation-harness's
`loglikelihood` requests compute it, for decoders and encoder-decoders.

Encoding follows lm-evaluation-harness's `_encode_pair`: the context's trailing whitespace moves to the
continuation, the whole text is encoded once, and the continuation's tokens are those after the
context's own encoding. A decoder runs each context once for all its choices, and the prefix common
to every context (few-shot examples) once for the call, through the KV cache; only the positions that
predict a choice go through the LM head; the questions of one batch have similar lengths. Every row
fits the model's positions (bench.run checks that first), so nothing is cut.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

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


def check_fits(model, requests: list[Request], what: str, hint: str = "") -> None:
    """One line when a question (context and its longest choice) is longer than the model's positions:
    checked before anything is scored, so scoring never cuts a row."""
    limit = getattr(model.cfg, "max_seq_len", 0)
    longest = max((len(r.context) + len(r.continuation) for r in requests), default=0)
    if limit and longest > limit + 1:
        raise UserError(
            f"{what}: a question of {longest} tokens does not fit the model's {limit} positions"
            + (f" ({hint})" if hint else "")
        )


MIN_SHARED = 8  # tokens: a shorter prefix common to a whole batch is not worth a pass of its own


def _shared_prefix(model, groups: list[list[Request]], device) -> tuple[list[int], list | None]:
    """The tokens every context starts with (the description and few-shot examples), run once for the
    whole call: (those tokens, their KV caches), or ([], None) when they are too few to be worth it.
    Every context keeps at least its last token to run (its position predicts the choices)."""
    contexts = [g[0].context for g in groups]  # a lone choice's row starts with its context too
    shared = _common_prefix(contexts)[: min(len(c) for c in contexts) - 1]
    if len(shared) < MIN_SHARED:
        return [], None
    caches = model.new_caches(len(shared))
    model(torch.tensor([shared], device=device), caches=caches)  # (1, P)
    return shared, caches


def _decoder_batch(
    model, groups: list[list[Request]], pad: int, device, shared: list[int], prefix: list | None
) -> list[list[tuple[float, bool]]]:
    """A batch of questions, each a group of choices after one context (or one choice alone, its
    row context and choice), in passes that share what can be shared through the KV cache:

    1. the prefix common to every context (`shared`, `prefix`: its caches), run once for the call;
    2. each group's row after it: a shared context once for all its choices (its last position gives
       every choice's first token), a lone choice's context and choice; left-padded when a cache is
       read or kept (the pads sit between the prefix and the row, unseen, positions counting real
       tokens only), else right-padded through SDPA's causal path, with no cache at all;
    3. a shared context's choices of more than one token, one row each after the cached context.

    Only the positions that predict a choice's tokens go through the LM head."""
    rows = [_row(g)[len(shared) :] for g in groups]
    width = max(len(r) for r in rows)
    longer = [(g, c) for g, group in enumerate(groups) if len(group) > 1 for c, r in enumerate(group)]
    longer = [(g, c) for g, c in longer if len(groups[g][c].continuation) > 1]
    tail = max((len(groups[g][c].continuation) for g, c in longer), default=1) - 1  # pass 3's width
    ids = torch.full((len(groups), width), pad, dtype=torch.long)
    if not shared and not longer:  # nothing cached before or after: right-padded rows, SDPA's causal path
        for g, row in enumerate(rows):
            ids[g, : len(row)] = torch.tensor(row)
        hidden, ends, caches = model(ids.to(device)), [len(r) for r in rows], None  # (G, width, D)
    else:
        caches = model.new_caches(len(shared) + width + tail)
        for c, p in zip(caches, prefix or []):
            c.append(*(t[:, :, : p.length].expand(len(groups), -1, -1, -1) for t in (p.k, p.v)))
        key_mask = torch.zeros(len(groups), len(shared) + width, dtype=torch.long)
        key_mask[:, : len(shared)] = 1
        for g, row in enumerate(rows):
            ids[g, width - len(row) :] = torch.tensor(row)
            key_mask[g, len(shared) + width - len(row) :] = 1
        key_mask = key_mask.to(device)
        hidden, ends = model(ids.to(device), caches=caches, key_mask=key_mask), [width] * len(rows)  # pass 2
    out = []
    for g, group in enumerate(groups):
        n = len(group[0].continuation) if len(group) == 1 else 1  # the positions predicting what is scored
        logp = torch.log_softmax(model.logits(hidden[g : g + 1, ends[g] - n : ends[g]])[0].float(), dim=-1)  # (n, V)
        out.append([_score(logp, r.continuation if len(group) == 1 else r.continuation[:1]) for r in group])
    if longer:
        for c in caches:
            c.select(torch.tensor([g for g, _ in longer], device=device))
        ids = torch.full((len(longer), tail), pad, dtype=torch.long)
        own = torch.zeros(len(longer), tail, dtype=torch.long)
        for i, (g, c) in enumerate(longer):
            rest = groups[g][c].continuation[:-1]  # right-padded: a causal query never reaches the pads
            ids[i, : len(rest)], own[i, : len(rest)] = torch.tensor(rest), 1
        rows_of = torch.tensor([g for g, _ in longer])
        hidden = model(ids.to(device), caches=caches, key_mask=torch.cat([key_mask[rows_of], own.to(device)], 1))
        for i, (g, c) in enumerate(longer):  # hidden: (R, tail, D), pass 3
            target = groups[g][c].continuation
            logp = torch.log_softmax(model.logits(hidden[i : i + 1, : len(target) - 1])[0].float(), dim=-1)
            ll, greedy = _score(logp, target[1:])
            out[g][c] = (out[g][c][0] + ll, out[g][c][1] and greedy)
    return out


def _row(group: list[Request]) -> list[int]:
    """What pass 2 reads of a group: a shared context, or a lone choice's context and choice but its
    last token (nothing predicts after it)."""
    first = group[0]
    return first.context + first.continuation[:-1] if len(group) == 1 else first.context


def _common_prefix(rows: list[list[int]]) -> list[int]:
    first, n = rows[0], min(len(r) for r in rows)
    for other in rows[1:]:
        n = next((i for i in range(n) if other[i] != first[i]), n)
    return first[:n]


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
        [
            _score(
                torch.log_softmax(model.logits(hidden[i : i + 1, : len(r.continuation)])[0].float(), -1), r.continuation
            )
        ]
        for i, r in enumerate(batch)
    ]


def _score(logp: Tensor, tokens: list[int]) -> tuple[float, bool]:
    """(n, vocab) or (vocab,) log-probabilities of the positions predicting n tokens -> (their summed
    log-probability, whether each token is the argmax)."""
    logp = logp if logp.dim() == 2 else logp[None]
    target = torch.tensor(tokens, device=logp.device)
    return float(logp.gather(1, target[:, None]).sum()), bool((logp.argmax(-1) == target).all())


@torch.no_grad()
def score(model, requests: list[Request], pad: int, batch_size: int, progress=None) -> list[Score]:
    """Every request's log-likelihood, in batches of similar lengths (longest first, so a batch that
    does not fit in memory fails at once). A decoder runs each question's context once for all its
    choices, and the prefix common to every context once; an encoder-decoder reads each choice as a
    row of its own."""
    if not requests:
        return []
    device = next(model.parameters()).device
    seq2seq = kinds.is_seq2seq(model)
    groups = [[i] for i in range(len(requests))] if seq2seq else _groups(requests)
    if seq2seq:
        run = _seq2seq_batch
    else:
        shared, prefix = _shared_prefix(model, [[requests[i] for i in g] for g in groups], device)
        run = partial(_decoder_batch, shared=shared, prefix=prefix)
    groups.sort(key=lambda g: -max(len(requests[i].context) + len(requests[i].continuation) for i in g))
    results: dict[int, Score] = {}
    for batch in _batches(groups, requests, batch_size):
        scored = run(model, [[requests[i] for i in g] for g in batch], pad, device)
        for group, group_scores in zip(batch, scored):
            for i, (ll, greedy) in zip(group, group_scores):
                results[i] = Score(requests[i].question, requests[i].choice, ll, greedy)
        if progress is not None:
            progress(sum(len(g) for g in batch))
    return [results[i] for i in range(len(requests))]


def _groups(requests: list[Request]) -> list[list[int]]:
    """The requests of one question after one context share a row of that context when it pays:
    choices of one token each (MMLU's letters), or a context at least as long as the longest choice
    (HellaSwag). Otherwise (PIQA: a short goal, long solutions) each choice is a row of its own,
    context and choice, which wastes less on padding than the shared context saves."""
    by_context: dict[tuple, list[int]] = {}
    for i, r in enumerate(requests):
        by_context.setdefault((r.question, tuple(r.context)), []).append(i)
    groups = []
    for members in by_context.values():
        longest = max(len(requests[i].continuation) for i in members)
        if longest == 1 or len(requests[members[0]].context) >= longest:
            groups.append(members)
        else:
            groups += [[i] for i in members]
    return groups


def _batches(groups: list[list[int]], requests: list[Request], batch_size: int):
    """Consecutive groups whose widest pass has at most batch_size rows: a group is one row of its
    context, and a shared context one more row per choice of more than one token."""
    batch, rows = [], 0
    for g in groups:
        n = max(1, sum(len(requests[i].continuation) > 1 for i in g)) if len(g) > 1 else 1
        if batch and rows + n > batch_size:
            yield batch
            batch, rows = [], 0
        batch.append(g)
        rows += n
    if batch:
        yield batch


def auto_batch_size(model, requests: list[Request], most: int = 64) -> int:
    """`--batch-size auto`: the largest power of two (up to `most`) whose widest pass over the longest
    question fits in half the free memory (a GPU's free memory; on a CPU, MemAvailable, since a CPU
    allocation too large is killed rather than raised). Per row: the KV cache of every layer, one
    layer's attention scores and its widest activations, over the longest row's tokens."""
    from ..models.blocks import Attention

    device = next(model.parameters()).device
    size = next(model.parameters()).element_size()
    tokens = max((len(r.context) + len(r.continuation) for r in requests), default=1)
    attention = [m for m in model.modules() if isinstance(m, Attention) and not m.cross]
    widest = max(m.out_features for m in model.modules() if isinstance(m, torch.nn.Linear))
    per_row = tokens * (
        sum(2 * a.kv_inner * size for a in attention)  # the KV cache
        + max((a.n_head for a in attention), default=1) * tokens * 5  # fp32 scores and a boolean mask
        + 8 * widest * size  # activations of the widest layer, with room
    )
    batch = 1
    while batch * 2 <= most and batch * 2 * per_row <= _free_bytes(device) / 2:
        batch *= 2
    return batch


def _free_bytes(device) -> int:
    from ..engine.memory import available_ram

    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    available = available_ram()
    return int(available) if available is not None else 8 << 30  # unknown: assume a small machine
