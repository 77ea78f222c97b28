"""Batches of instruction examples (data/conversations.py) for the one Sampler, and their losses.

A decoder's batch is one example per row, right-padded (the sampler groups rows of similar length),
or, with packing, several whole examples per row: each attends only to itself and its positions
restart (`doc_ids`, the document-mask path of packed pretraining blocks), so a packed example's
loss is its loss alone. Targets are IGNORE wherever a token is not trained (prompts, padding, the
first token of every packed example), and only trained positions reach the output projection.
An encoder-decoder's batch is the padded source and the reply as T5 targets.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

from ..data import IGNORE
from ..data.conversations import DecoderExamples, Example, Seq2SeqExample, Seq2SeqExamples
from ..data.sampler import Draw, Source
from ..models import kinds
from ..models.vlm import image_inputs
from ..objectives.losses import linear_cross_entropy, lm_head, seq2seq_loss, shift_right


def decoder_loss(model: nn.Module, heads: nn.ModuleDict, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
    """Mean cross-entropy of the trained tokens, and how many of them the model already predicts.
    Only trained positions go through the LM head: a prompt's positions cost the blocks, not the
    (tokens x vocabulary) projection."""
    hidden = model(batch["input_ids"], doc_ids=batch.get("doc_ids"), **image_inputs(batch))  # (B, T, D)
    targets = batch["targets"]  # (B, T), IGNORE where nothing is learned
    valid = targets != IGNORE
    head = lm_head(model, hidden[valid])
    value, correct = linear_cross_entropy(
        head.hidden, head.weight, targets[valid], with_accuracy=True, softcap=head.softcap
    )
    return value, {"loss": value.detach(), "token_acc": correct.float() / valid.sum().clamp(min=1)}


def decoder_targets(batch: dict[str, Tensor]) -> Tensor:
    """The trained tokens of a decoder batch: what its loss averages over."""
    return (batch["targets"] != IGNORE).sum()


def seq2seq_targets(batch: dict[str, Tensor]) -> Tensor:
    return (batch["labels"] != IGNORE).sum()


def decoder_rows(rows: list[list[Example]], pad_id: int) -> dict[str, Tensor]:
    """Rows of one or more examples each -> input_ids, targets (B, T) and, where a row holds several,
    doc_ids (B, T): every example's own number, the padding after them another."""
    width = max(sum(len(e.ids) for e in row) for row in rows) - 1
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    targets = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    docs = torch.full((len(rows), width), len(max(rows, key=len)), dtype=torch.long)
    for r, row in enumerate(rows):
        tokens = np.concatenate([e.ids for e in row])
        trained = np.concatenate([e.trained for e in row])  # every example's first token is 0: never across
        n = len(tokens) - 1
        ids[r, :n] = torch.from_numpy(tokens[:-1])
        targets[r, :n] = torch.from_numpy(np.where(trained[1:] > 0, tokens[1:], IGNORE))
        docs[r, :n] = torch.from_numpy(np.repeat(np.arange(len(row)), [len(e.ids) for e in row])[:-1])
    out = {"input_ids": ids, "targets": targets}
    frames = [image.pixels() for row in rows for e in row for image in e.images]  # each (F_i, C, S, S)
    if frames:  # a vision-language model's: its image tokens' frames, in the order the tokens come
        out["pixel_values"] = torch.cat(frames)
    return {**out, "doc_ids": docs} if any(len(row) > 1 for row in rows) else out


class PaddedReplies(Source):
    """One decoder example per row, right-padded to the longest of its batch (a causal decoder never
    reads a pad on its right); `lengths` lets the sampler group similar lengths."""

    def __init__(self, examples: list[Example], pad_id: int):
        self.examples, self.pad = examples, pad_id
        self.lengths = np.array([len(e.ids) for e in examples])

    def epoch_size(self, epoch: int) -> int:
        return len(self.examples)

    def batch(self, draw: Draw) -> dict[str, Tensor]:
        return decoder_rows([[self.examples[i]] for i in draw.indices], self.pad)


def pack(lengths: np.ndarray, capacity: int, seed: int) -> list[list[int]]:
    """Example indices in rows of at most `capacity` tokens: best fit, longest first (TRL's packing
    strategy), ties in a seeded order. Every example stays whole."""
    order = np.random.default_rng([seed, 5150]).permutation(len(lengths))
    order = order[np.argsort(-lengths[order], kind="stable")]
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, row), sorted
    for i in order:
        n = int(lengths[i])
        at = bisect.bisect_left(free, (n, -1))
        if at == len(free):
            rows.append([int(i)])
            bisect.insort(free, (capacity - n, len(rows) - 1))
            continue
        room, row = free.pop(at)
        rows[row].append(int(i))
        bisect.insort(free, (room - n, row))
    return rows


class PackedReplies(Source):
    """Several whole decoder examples per row of at most `capacity` tokens, packed once (seeded);
    an epoch is every row once, shuffled by the sampler."""

    def __init__(self, examples: list[Example], capacity: int, pad_id: int, seed: int):
        self.examples, self.pad = examples, pad_id
        self.rows = pack(np.array([len(e.ids) for e in examples]), capacity, seed)

    def epoch_size(self, epoch: int) -> int:
        return len(self.rows)

    def batch(self, draw: Draw) -> dict[str, Tensor]:
        return decoder_rows([[self.examples[i] for i in self.rows[r]] for r in draw.indices], self.pad)


class Seq2SeqReplies(Source):
    """An encoder-decoder's examples: the source right-padded with its mask, the reply as targets
    (IGNORE-padded) and the decoder's input, the targets shifted right behind the pad (T5's start)."""

    def __init__(self, examples: list[Seq2SeqExample], pad_id: int):
        self.examples, self.pad = examples, pad_id
        self.lengths = np.array([len(e.source) + len(e.target) for e in examples])

    def epoch_size(self, epoch: int) -> int:
        return len(self.examples)

    def batch(self, draw: Draw) -> dict[str, Tensor]:
        rows = [self.examples[i] for i in draw.indices]
        s, t = max(len(e.source) for e in rows), max(len(e.target) for e in rows)
        ids = torch.full((len(rows), s), self.pad, dtype=torch.long)
        mask = torch.zeros((len(rows), s), dtype=torch.long)
        labels = torch.full((len(rows), t), IGNORE, dtype=torch.long)
        for r, e in enumerate(rows):
            ids[r, : len(e.source)], mask[r, : len(e.source)] = torch.from_numpy(e.source), 1
            labels[r, : len(e.target)] = torch.from_numpy(e.target)
        return {
            "input_ids": ids,
            "attention_mask": mask,
            "labels": labels,
            "decoder_input_ids": shift_right(labels, self.pad),
        }


class PairBatches(Source):
    """Preference pairs (data/preferences.py). With share_prompt, a batch of B pairs is B decoder rows:
    each the prompt once, the chosen reply, then the rejected one (shared_prompt (B, 2): where each
    reply starts; the model's blocks.replies_to_one_prompt), with `targets` the chosen reply's and
    `rejected_targets` the rejected one's, so a prompt costs one pass instead of two. Without it,
    2B rows: the chosen replies first, then the rejected ones. `reference` (N, 2), when the reference
    model's log-probabilities were computed ahead, rides along as ref_logps (2B,), chosen first.
    `other_targets` (ORPO, whose NLL reads the whole chosen sequence): the chosen sequences' other
    tokens (prompt, template), at the positions that predict them."""

    def __init__(
        self,
        pairs: list,
        pad_id: int,
        reference: Tensor | None = None,
        share_prompt: bool = True,
        other_targets: bool = False,
    ):
        self.pairs, self.pad, self.reference, self.share = pairs, pad_id, reference, share_prompt
        self.others = other_targets
        self.lengths = np.array([p.length for p in pairs])  # either layout: the same batches

    def epoch_size(self, epoch: int) -> int:
        return len(self.pairs)

    def batch(self, draw: Draw) -> dict[str, Tensor]:
        pairs = [self.pairs[i] for i in draw.indices]
        if self.share:
            out = shared_prompt_rows(pairs, self.pad)
        else:
            out = decoder_rows([[p.chosen] for p in pairs] + [[p.rejected] for p in pairs], self.pad)
        if self.others:
            out["other_targets"] = chosen_other_targets(pairs, out["input_ids"].shape)
        if self.reference is not None:
            picked = self.reference[torch.as_tensor(draw.indices)]  # (B, 2)
            out["ref_logps"] = torch.cat([picked[:, 0], picked[:, 1]])
        return out


def chosen_other_targets(pairs: list, shape: torch.Size) -> Tensor:
    """(rows, T): each chosen sequence's untrained tokens but its first, at the positions that predict
    them (in either layout the chosen sequence starts its row); IGNORE elsewhere."""
    out = torch.full(shape, IGNORE, dtype=torch.long)
    for r, pair in enumerate(pairs):
        c = pair.chosen
        out[r, : len(c.ids) - 1] = torch.from_numpy(np.where(c.trained[1:] > 0, IGNORE, c.ids[1:]))
    return out


def common_prefix(pair) -> int:
    """How many leading tokens the chosen and rejected examples share (the prompt, at least), less one
    so that each reply keeps a token of its own to be predicted from."""
    a, b = pair.chosen.ids, pair.rejected.ids
    n = min(len(a), len(b)) - 1
    differ = np.nonzero(a[:n] != b[:n])[0]
    return int(differ[0]) if len(differ) else n


def shared_length(pair) -> int:
    return len(pair.chosen.ids) + len(pair.rejected.ids) - common_prefix(pair)


def shared_prompt_rows(pairs: list, pad_id: int) -> dict[str, Tensor]:
    """Pairs -> one row each: input_ids (B, T) the shared prompt, the chosen reply's tokens, then the
    rejected reply's; targets / rejected_targets (B, T) each reply's next tokens at the positions that
    predict them (IGNORE elsewhere; the prompt's last position predicts both replies' first tokens);
    shared_prompt (B, 2) = (prompt length, where the rejected reply starts)."""
    shared_tokens = [common_prefix(p) for p in pairs]  # once per pair: it compares the two examples
    width = max(len(p.chosen.ids) + len(p.rejected.ids) - k for p, k in zip(pairs, shared_tokens)) - 1
    ids = torch.full((len(pairs), width), pad_id, dtype=torch.long)
    chosen_t = torch.full((len(pairs), width), IGNORE, dtype=torch.long)
    rejected_t = torch.full((len(pairs), width), IGNORE, dtype=torch.long)
    shared = torch.zeros(len(pairs), 2, dtype=torch.long)
    for r, (pair, k) in enumerate(zip(pairs, shared_tokens)):  # (a row's last token predicts nothing)
        c, j = pair.chosen, pair.rejected
        n = len(c.ids)
        tokens = np.concatenate([c.ids, j.ids[k:]])[:-1]
        ids[r, : len(tokens)] = torch.from_numpy(tokens)
        chosen_t[r, : n - 1] = torch.from_numpy(np.where(c.trained[1:] > 0, c.ids[1:], IGNORE))
        # the rejected sequence's position t sits at t in the row up to the shared prefix, then after the chosen
        at = np.concatenate([np.arange(k), n + np.arange(len(j.ids) - 1 - k)])  # (len(j) - 1,)
        rejected_t[r, torch.from_numpy(at)] = torch.from_numpy(np.where(j.trained[1:] > 0, j.ids[1:], IGNORE))
        shared[r] = torch.tensor([k, n])
    return {"input_ids": ids, "targets": chosen_t, "rejected_targets": rejected_t, "shared_prompt": shared}


def row_widths(batch: dict[str, Tensor]) -> Tensor:
    """(rows,) how much of each right-padded row is read: one past the last position that a target
    (`targets`, `rejected_targets`, ORPO's `other_targets`) or a score (`score_row`, `score_at`) reads.
    A causal model's states before that position never see what comes after it."""
    ids = batch["input_ids"]
    positions = torch.arange(1, ids.size(1) + 1, device=ids.device)
    widths = torch.ones(ids.size(0), dtype=torch.long, device=ids.device)
    for key, targets in batch.items():
        if key.endswith("targets"):
            widths = torch.maximum(widths, torch.where(targets != IGNORE, positions, 0).amax(1))
    if "score_at" in batch:
        widths = widths.scatter_reduce(0, batch["score_row"], batch["score_at"] + 1, "amax")
    return widths


def width_groups(widths: list[int], slack: float = 0.125) -> list[list[int]]:
    """Rows grouped widest first: a row joins the group before it while the group, cut to its widest
    row, stays within `slack` of padding (a group is one call of the model)."""
    groups: list[list[int]] = []
    for row in sorted(range(len(widths)), key=lambda r: -widths[r]):
        group = groups[-1] if groups else []
        if group and widths[group[0]] * (len(group) + 1) <= (1 + slack) * (sum(widths[r] for r in group) + widths[row]):
            group.append(row)
        else:
            groups.append([row])
    return groups


def hidden_states(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    """model(input_ids, shared_prompt=...) (rows, T, D) of a batch of right-padded rows, each group of
    rows of like width (width_groups) read only as far as its widest row is read (row_widths), zeros
    after: the padding a pair's long third part (a KTO row's mismatched reply, a long rejected reply)
    forces on every other row is never computed, and each row's states are those it has alone."""
    ids, shared = batch["input_ids"], batch.get("shared_prompt")
    widths = row_widths(batch).tolist()
    groups = width_groups(widths)
    if len(groups) == 1 and widths[groups[0][0]] == ids.size(1):
        return model(ids, shared_prompt=shared)
    parts = []
    for group in groups:
        rows, width = torch.tensor(group, device=ids.device), widths[group[0]]
        hidden = model(ids[rows, :width], shared_prompt=None if shared is None else shared[rows])
        parts.append(nn.functional.pad(hidden, (0, 0, 0, ids.size(1) - width)))
    order = torch.tensor([r for group in groups for r in group], device=ids.device)
    return torch.cat(parts)[torch.argsort(order)]


def pair_count(batch: dict[str, Tensor]) -> Tensor:
    """A preference batch's pairs: what its loss averages over."""
    return torch.tensor(batch["input_ids"].size(0) // (1 if "shared_prompt" in batch else 2))


@dataclass(frozen=True)
class ReplyFormat:
    """How a model is given a prompt and its reply, asked of the model once (reply_format): a decoder
    reads both as one sequence (a chat template, packing); an encoder-decoder reads the prompt with
    its encoder and writes the reply with its decoder (no template, no packing). Everything SFT does
    differently for the two follows from here."""

    seq2seq: bool
    loss: Callable
    loss_weight: Callable  # the trained tokens of a batch: what its loss averages over

    def builder(self, tokenizer, template, train_on: str, length: int, fields, fmt):
        if self.seq2seq:
            return Seq2SeqExamples(tokenizer, length, fields, fmt)
        return DecoderExamples(tokenizer, template, train_on, length, fields, fmt)

    def batches(self, examples: list, pad: int, pack_length: int = 0, seed: int = 0) -> Source:
        """Right-padded rows, or (pack_length > 0, a decoder's training split) rows packed to that length."""
        if self.seq2seq:
            return Seq2SeqReplies(examples, pad)
        return PackedReplies(examples, pack_length, pad, seed) if pack_length else PaddedReplies(examples, pad)

    def lengths(self, examples: list) -> tuple[int, int]:
        """(input, target) mean token counts for the model's flops_per_token: an encoder-decoder's
        source and target; a decoder's whole sequence."""
        if self.seq2seq:
            return int(np.mean([len(e.source) for e in examples])), int(np.mean([len(e.target) for e in examples]))
        return int(np.mean([len(e.ids) for e in examples])), 0


DECODER_REPLIES = ReplyFormat(False, decoder_loss, decoder_targets)
SEQ2SEQ_REPLIES = ReplyFormat(True, seq2seq_loss, seq2seq_targets)


def reply_format(model) -> ReplyFormat:
    return SEQ2SEQ_REPLIES if kinds.is_seq2seq(model) else DECODER_REPLIES


def count_tokens(batch: dict) -> int:
    """The tokens a batch reads: the (padded) decoder sequence, or an encoder-decoder's both sides."""
    return int(batch["input_ids"].numel() + (batch["labels"].numel() if "labels" in batch else 0))


class RewardBatches(Source):
    """Preference pairs for a reward model, whose score is read at each sequence's last token. With
    share_prompt, a row per pair: the prompt once, the chosen reply, then the rejected one (as
    PairBatches lays it out, every token kept); without, 2B rows, the chosen sequences first.
    `score_at` (2B,) with `score_row` (2B,): where each sequence's last token is, chosen first;
    `margin` (B,) the pairs' margins when any pair has one."""

    def __init__(self, pairs: list, pad_id: int, share_prompt: bool = True):
        self.pairs, self.pad, self.share = pairs, pad_id, share_prompt
        self.lengths = np.array([p.length for p in pairs])

    def epoch_size(self, epoch: int) -> int:
        return len(self.pairs)

    def batch(self, draw: Draw) -> dict[str, Tensor]:
        pairs = [self.pairs[i] for i in draw.indices]
        out = reward_rows(pairs, self.pad) if self.share else reward_rows_apart(pairs, self.pad)
        if any(p.margin for p in pairs):
            out["margin"] = torch.tensor([p.margin for p in pairs], dtype=torch.float32)
        return out


def reward_rows(pairs: list, pad_id: int) -> dict[str, Tensor]:
    """A row per pair: the shared prompt, the chosen sequence's own tokens, the rejected one's
    (shared_prompt (B, 2) as shared_prompt_rows gives it); each scored at its last token."""
    shared_tokens = [common_prefix(p) for p in pairs]
    rows = [np.concatenate([p.chosen.ids, p.rejected.ids[k:]]) for p, k in zip(pairs, shared_tokens)]
    ids = torch.full((len(pairs), max(len(r) for r in rows)), pad_id, dtype=torch.long)
    for r, row in enumerate(rows):
        ids[r, : len(row)] = torch.from_numpy(row)
    ends = torch.tensor([len(p.chosen.ids) for p in pairs])  # where the rejected sequence's own tokens start
    every = torch.arange(len(pairs))
    return {
        "input_ids": ids,
        "shared_prompt": torch.stack([torch.tensor(shared_tokens), ends], dim=1),
        "score_row": torch.cat([every, every]),
        "score_at": torch.cat([ends - 1, torch.tensor([len(r) - 1 for r in rows])]),
    }


def reward_rows_apart(pairs: list, pad_id: int) -> dict[str, Tensor]:
    """2B right-padded rows, the chosen sequences first, each scored at its last token."""
    return last_token_rows([p.chosen.ids for p in pairs] + [p.rejected.ids for p in pairs], pad_id)


def last_token_rows(sequences: list[np.ndarray], pad_id: int) -> dict[str, Tensor]:
    """Right-padded rows of token ids, each to be scored at its last token."""
    ids = torch.full((len(sequences), max(len(s) for s in sequences)), pad_id, dtype=torch.long)
    for r, seq in enumerate(sequences):
        ids[r, : len(seq)] = torch.as_tensor(seq)
    return {
        "input_ids": ids,
        "score_row": torch.arange(len(sequences)),
        "score_at": torch.tensor([len(s) - 1 for s in sequences]),
    }
