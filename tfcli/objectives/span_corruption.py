"""T5 span corruption: drop 15% of the tokens in spans of mean length 3, each span replaced by
one sentinel in the input; the target spells out each sentinel followed by the tokens it hid.

Faithful to the T5 codebase (t5.data.preprocessors): `random_spans_noise_mask` picks the number
of noise tokens and spans as T5 does (a non-noise span first, a noise span last, spans never
empty), `compute_input_and_target_lengths` picks how many raw tokens to cut so that the noised
input fills the encoder length exactly, and the decoder input is the target shifted right behind
the start token (the pad id, as T5). Example, noise spans marked:

    Thank you [for inviting] me to your party [last] week .
    input   Thank you <extra_id_0> me to your party <extra_id_1> week . </s>
    target  <extra_id_0> for inviting <extra_id_1> last </s>       (T5 ends on a noise span)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

from ..data.packing import BlockSource, split_stores
from ..data.sampler import Draw
from ..errors import UserError
from ..models import kinds, t5
from ..plugin import Job
from .losses import seq2seq_loss as loss  # noqa: F401  (the objective's loss; text-to-text tasks train it too)
from .losses import shift_right
from .objective import TextObjective

SENTINELS = list(t5.SENTINELS)  # <extra_id_0> ... <extra_id_99>
N_SENTINELS = len(SENTINELS)
SPECIAL_TOKENS = list(t5.T5.special_tokens)  # T5's ids: pad 0, eos 1, unk 2, then the sentinels
NOISE_DENSITY = 0.15
MEAN_SPAN_LENGTH = 3.0


def noise_counts(length: int, noise_density: float, mean_span_length: float) -> tuple[int, int]:
    """(noise tokens, noise spans) in `length` tokens, with T5's guards against empty spans."""
    length = max(length, 2)
    n_noise = min(max(int(round(length * noise_density)), 1), length - 1)
    n_spans = max(int(round(n_noise / mean_span_length)), 1)
    return n_noise, n_spans


def compute_input_and_target_lengths(
    inputs_length: int, noise_density: float = NOISE_DENSITY, mean_span_length: float = MEAN_SPAN_LENGTH
) -> tuple[int, int]:
    """(raw tokens to cut, target length) so that the noised input is exactly `inputs_length` long:
    non-noise tokens + one sentinel per span + EOS (T5's random_spans_helper; 512 -> 568, 114)."""

    def lengths(tokens: int) -> tuple[int, int]:
        n_noise, n_spans = noise_counts(tokens, noise_density, mean_span_length)
        return tokens - n_noise + n_spans + 1, n_noise + n_spans + 1

    tokens = inputs_length - 1
    while lengths(tokens + 1)[0] <= inputs_length:
        tokens += 1
    targets = lengths(tokens)[1]
    if noise_density == 0.5 and targets > inputs_length:  # T5's hack to keep targets a round number
        tokens, targets = tokens - 1, targets - 1
    return tokens, targets


def _random_segmentation(n_items: int, n_segments: int, rng: np.random.Generator) -> np.ndarray:
    """Split n_items into n_segments non-empty runs at random -> (n_segments,) run lengths."""
    first = np.zeros(n_items, dtype=bool)
    first[1:] = rng.permutation(np.arange(n_items - 1) < n_segments - 1)  # where a new run starts
    return np.bincount(np.cumsum(first), minlength=n_segments)


def random_spans_noise_mask(
    length: int,
    rng: np.random.Generator,
    noise_density: float = NOISE_DENSITY,
    mean_span_length: float = MEAN_SPAN_LENGTH,
) -> np.ndarray:
    """(length,) bool, True = noise: alternating non-noise / noise spans, starting non-noise."""
    n_noise, n_spans = noise_counts(length, noise_density, mean_span_length)
    n = max(length, 2)
    noise_lengths = _random_segmentation(n_noise, n_spans, rng)  # (n_spans,)
    keep_lengths = _random_segmentation(n - n_noise, n_spans, rng)  # (n_spans,)
    interleaved = np.stack([keep_lengths, noise_lengths], axis=1).reshape(-1)  # keep0 noise0 keep1 ...
    starts = np.zeros(n, dtype=np.int64)
    starts[np.cumsum(interleaved)[:-1]] = 1
    return (np.cumsum(starts) % 2 == 1)[:length]


def _replace_spans(tokens: np.ndarray, mask: np.ndarray, sentinels: np.ndarray) -> np.ndarray:
    """Replace each run of masked tokens by the next sentinel (T5's noise_span_to_unique_sentinel)."""
    prev = np.concatenate([[False], mask[:-1]])
    first = mask & ~prev  # (N,) where a span begins
    span = np.cumsum(first) - 1
    out = np.where(first, sentinels[np.clip(span, 0, len(sentinels) - 1)], tokens)
    return out[~(mask & prev)]  # drop the rest of every span


def corrupt(tokens: np.ndarray, mask: np.ndarray, sentinels: np.ndarray, eos_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(N,) raw ids and noise mask -> (input ids, target ids), each ending in EOS."""
    if int((mask & ~np.concatenate([[False], mask[:-1]])).sum()) > len(sentinels):
        raise UserError(f"{len(sentinels)} sentinels cannot mark this many spans; lower data.seq_len")
    inputs = _replace_spans(tokens, mask, sentinels)
    # in the target the kept tokens are the 'spans'; with T5's mask the k-th kept span precedes the
    # k-th noise span, so each sentinel is followed by exactly the tokens it hid in the input
    targets = _replace_spans(tokens, ~mask, sentinels)
    return np.append(inputs, eos_id), np.append(targets, eos_id)


@dataclass
class SpanCorruptor:
    """Turns raw blocks of `raw_len` tokens into encoder inputs, targets and decoder inputs."""

    sentinels: np.ndarray
    eos_id: int
    start_id: int  # T5 starts decoding from the pad id
    noise_density: float = NOISE_DENSITY
    mean_span_length: float = MEAN_SPAN_LENGTH

    def __call__(self, raw: np.ndarray, rngs: list[np.random.Generator]) -> dict[str, Tensor]:
        """raw (B, N) and each row's random generator -> input_ids (B, S), labels (B, T), decoder_input_ids (B, T)."""
        pairs = [
            corrupt(
                row,
                random_spans_noise_mask(len(row), rng, self.noise_density, self.mean_span_length),
                self.sentinels,
                self.eos_id,
            )
            for row, rng in zip(raw, rngs)
        ]
        inputs = torch.from_numpy(np.stack([p[0] for p in pairs]))
        labels = torch.from_numpy(np.stack([p[1] for p in pairs]))
        return {"input_ids": inputs, "labels": labels, "decoder_input_ids": shift_right(labels, self.start_id)}


class CorruptedBlocks(BlockSource):
    """Raw blocks of `raw_len` tokens, each corrupted with noise from its own random stream."""

    def __init__(self, span, raw_len: int, corruptor: SpanCorruptor, seed: int = 0, shift: bool = True):
        super().__init__(span, raw_len - 1, seed, shift)
        self.corruptor = corruptor

    def batch(self, draw: Draw) -> dict[str, Tensor]:
        raw = self.blocks(self.starts(draw)).numpy()  # (B, raw_len)
        return self.corruptor(raw, [draw.rng(i) for i in range(len(draw))])


def make_corruptor(tokenizer) -> SpanCorruptor:
    ids = [tokenizer.token_id(s) for s in SENTINELS]
    pad, eos = tokenizer.token_id("<pad>"), tokenizer.token_id("</s>")
    if None in ids or pad is None or eos is None:
        raise UserError(
            "span corruption needs a tokenizer with <pad>, </s> and <extra_id_0..99> "
            "(train one: tokenizer.kind unigram or bpe)"
        )
    return SpanCorruptor(np.array(ids, dtype=np.int64), eos_id=eos, start_id=pad)


class SpanCorruption(TextObjective):
    key = "span"
    streaming = True  # reads data.streaming sources
    model_kinds = (kinds.ENCODER_DECODER,)
    recipe_pattern = "{family}-mini"
    describe = "T5 span corruption"

    def setup(self, recipe, backbone) -> Job:
        """Tokenize into a store (cached), cut raw blocks long enough to fill the encoder after noising,
        corrupt each as its batch is made."""
        d = recipe.data
        raw_len, targets_len = compute_input_and_target_lengths(d.seq_len)
        if targets_len > backbone.cfg.max_seq_len:
            raise UserError(f"targets of {targets_len} tokens exceed model.max_seq_len ({backbone.cfg.max_seq_len})")
        corruptor = make_corruptor(backbone.tokenizer)
        if d.document_mask:
            raise UserError("data.document_mask applies to next-token blocks (--objective clm)")
        if d.streaming:
            source, held_out = self.streams(recipe, backbone, raw_len, corruptor)
        else:
            train, val = split_stores(*self.stores(recipe, backbone.tokenizer), d.val_fraction, raw_len - 1)
            source = CorruptedBlocks(train, raw_len, corruptor, recipe.train.seed)
            held_out = CorruptedBlocks(val, raw_len, corruptor, shift=False) if len(val) >= raw_len else None
        return Job(
            heads=nn.ModuleDict(),
            loss=loss,
            train=source,
            val=held_out,
            flops_per_item=backbone.model.flops_per_token(d.seq_len, targets_len),
            count_items=lambda b: b["input_ids"].numel() + b["labels"].numel(),
        )

    def hints(self, run_dir) -> list[str]:
        return [
            f'generate from it:  tfcli generate --checkpoint {run_dir} --prompt "... <extra_id_0> ..."',
            f"evaluate it:       tfcli eval --checkpoint {run_dir}",
        ]
