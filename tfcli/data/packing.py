"""From documents to fixed-length blocks: cached tokenization, one token stream, block sources.

Tokenization goes through `datasets.map` with a fingerprint made of the data's fingerprint and
the tokenizer's, so a second run over the same data with the same tokenizer loads the cached
Arrow file instead of tokenizing again. Blocks are `sampler.Source`s: the one sampler shuffles,
slices per rank and resumes them.
"""
from __future__ import annotations

import hashlib

import numpy as np
import torch

from ..display import phase
from ..errors import UserError
from ..sampler import Draw, Source
from .tokenizers import TextTokenizer


def tokenize(docs, tokenizer: TextTokenizer, *, append_eos: bool = True):
    """Dataset of `text` -> Dataset of `input_ids` (one row per document), cached by fingerprint."""
    eos = tokenizer.eos_id if append_eos else None
    tail = [eos] if eos is not None else []

    def encode(batch):
        return {"input_ids": [ids + tail for ids in tokenizer.encode_batch(batch["text"])]}

    fingerprint = hashlib.sha256(f"{docs._fingerprint}|{tokenizer.fingerprint()}|{eos}|v1".encode()).hexdigest()[:16]
    with phase(f"tokenizing {len(docs):,} documents"):
        return docs.map(encode, batched=True, batch_size=256, remove_columns=docs.column_names,
                        new_fingerprint=fingerprint, desc="tokenizing")


def token_stream(tokenized) -> np.ndarray:
    """All documents' ids end to end, as one int64 array (read straight from Arrow, no Python lists)."""
    column = tokenized.data.column("input_ids").combine_chunks()
    return column.flatten().to_numpy().astype(np.int64)


def split_stream(stream: np.ndarray, val_fraction: float, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Hold out the last `val_fraction` of the stream (contiguous, so no block straddles the split)."""
    n_val = int(len(stream) * val_fraction)
    train, val = stream[: len(stream) - n_val], stream[len(stream) - n_val:]
    if len(train) < seq_len + 1:
        raise UserError(f"training data has {len(train)} tokens, fewer than one block of {seq_len + 1}")
    if val_fraction > 0 and len(val) < seq_len + 1:
        raise UserError(f"held-out data has {len(val)} tokens, fewer than one block of {seq_len + 1}; "
                        f"raise data.val_fraction or give data.val_source")
    return train, val


def train_and_val_streams(docs: dict, tokenizer: TextTokenizer, data, block: int) -> tuple[np.ndarray, np.ndarray]:
    """Token streams of the training documents and of the held-out ones (data.val_source), or the
    training stream's tail (data.val_fraction) when there are none."""
    stream = token_stream(tokenize(docs["train"], tokenizer))
    if docs.get("val") is not None:
        return stream, token_stream(tokenize(docs["val"], tokenizer))
    return split_stream(stream, data.val_fraction, block)


class BlockSource(Source):
    """Hugging Face's group_texts: non-overlapping blocks of seq_len + 1 tokens (inputs and the
    targets one to the right). With shift=True each epoch starts the grid at an offset drawn from
    (seed, epoch), so every epoch sees new block boundaries."""

    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int = 0, shift: bool = True):
        self.tokens, self.seq_len, self.seed = tokens, seq_len, seed
        self.shift = shift and len(tokens) > 2 * (seq_len + 1)

    def offset(self, epoch: int) -> int:
        return int(np.random.default_rng([self.seed, epoch, 7]).integers(0, self.seq_len)) if self.shift else 0

    def epoch_size(self, epoch: int) -> int:
        return max(0, (len(self.tokens) - self.offset(epoch) - 1) // self.seq_len)

    def starts(self, draw: Draw) -> list[int]:
        return [self.offset(int(e)) + int(i) * self.seq_len for e, i in zip(draw.epochs, draw.indices)]

    def blocks(self, starts: list[int]) -> torch.Tensor:
        """(B, seq_len + 1) token blocks beginning at `starts`."""
        return torch.from_numpy(np.stack([self.tokens[s: s + self.seq_len + 1] for s in starts]))

    def batch(self, draw: Draw) -> dict[str, torch.Tensor]:
        block = self.blocks(self.starts(draw))
        return {"input_ids": block[:, :-1], "targets": block[:, 1:]}


class WindowSource(BlockSource):
    """nanoGPT's get_batch: each example is a window at a position drawn from its own random stream
    (more variety per token on small corpora). An 'epoch' is as many windows as the stream has blocks."""

    shuffle = False

    def __init__(self, tokens: np.ndarray, seq_len: int):
        super().__init__(tokens, seq_len, shift=False)

    def starts(self, draw: Draw) -> list[int]:
        last = len(self.tokens) - self.seq_len - 1
        return [int(draw.rng(i).integers(0, last, endpoint=True)) for i in range(len(draw))]
