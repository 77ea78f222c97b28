"""From documents to training batches: cached tokenization, one token stream, fixed-length blocks.

Tokenization goes through `datasets.map` with a fingerprint made of the data's fingerprint and
the tokenizer's, so a second run over the same data with the same tokenizer loads the cached
Arrow file instead of tokenizing again.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Iterator, Optional

import numpy as np
import torch

from ..errors import UserError
from .tokenizers import TextTokenizer


def tokenize(docs, tokenizer: TextTokenizer, *, append_eos: bool = True):
    """Dataset of `text` -> Dataset of `input_ids` (one row per document), cached by fingerprint."""
    eos = tokenizer.eos_id if append_eos else None
    tail = [eos] if eos is not None else []

    def encode(batch):
        return {"input_ids": [ids + tail for ids in tokenizer.encode_batch(batch["text"])]}

    fingerprint = hashlib.sha256(f"{docs._fingerprint}|{tokenizer.fingerprint()}|{eos}|v1".encode()).hexdigest()[:16]
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


@dataclass
class BlockSampler:
    """Shuffled fixed-length blocks of `seq_len + 1` tokens from a stream; resumable.

    Blocks (Hugging Face's group_texts, the default): each epoch starts the block grid at a random offset (so every epoch sees new boundaries) and
    visits the blocks in a random order, both drawn from (seed, epoch). The sampler hands out the
    *global* batch of `batch_size * world_size` blocks and keeps this rank's slice, so the data
    order does not depend on how many processes share the work.
    Windows (nanoGPT's get_batch): every batch draws its block starts uniformly from the whole
    stream, from (seed, batch number); more variety per token on small corpora.
    """

    tokens: np.ndarray
    seq_len: int
    batch_size: int
    seed: int
    rank: int = 0
    world_size: int = 1
    windows: bool = False  # nanoGPT style: every position may start a block, drawn at random
    epoch: int = 0
    index: int = 0  # position within this epoch's order (windows: batches drawn so far)

    def __post_init__(self):
        self._order_epoch: Optional[int] = None

    def _order(self) -> tuple[int, np.ndarray]:
        if self._order_epoch != self.epoch:
            rng = np.random.default_rng([self.seed, self.epoch])
            offset = int(rng.integers(0, self.seq_len)) if len(self.tokens) > 2 * (self.seq_len + 1) else 0
            n_blocks = (len(self.tokens) - offset - 1) // self.seq_len
            self._cached = (offset, rng.permutation(n_blocks))
            self._order_epoch = self.epoch
        return self._cached

    def _window_starts(self, global_batch: int) -> list[int]:
        rng = np.random.default_rng([self.seed, self.index])
        self.index += 1
        return rng.integers(0, len(self.tokens) - self.seq_len - 1, size=global_batch, endpoint=True).tolist()

    def next_batch(self) -> dict[str, torch.Tensor]:
        starts = []
        global_batch = self.batch_size * self.world_size
        if self.windows:
            starts = self._window_starts(global_batch)
        while len(starts) < global_batch:
            offset, order = self._order()
            if self.index >= len(order):
                self.epoch, self.index = self.epoch + 1, 0
                continue
            starts.append(offset + int(order[self.index]) * self.seq_len)
            self.index += 1
        mine = starts[self.rank * self.batch_size: (self.rank + 1) * self.batch_size]
        block = torch.from_numpy(np.stack([self.tokens[s: s + self.seq_len + 1] for s in mine]))
        return {"input_ids": block[:, :-1], "targets": block[:, 1:]}

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.index = int(state["epoch"]), int(state["index"])


def sequential_blocks(tokens: np.ndarray, seq_len: int, batch_size: int, max_batches: int,
                      rank: int = 0, world_size: int = 1) -> Iterator[dict[str, torch.Tensor]]:
    """Held-out batches: consecutive blocks from the start, the same every evaluation."""
    n_blocks = (len(tokens) - 1) // seq_len
    per_step = batch_size * world_size
    for b in range(min(max_batches, max(1, n_blocks // per_step))):
        first = b * per_step + rank * batch_size
        ids = [i for i in range(first, first + batch_size) if i < n_blocks]
        if not ids:
            return
        block = torch.from_numpy(np.stack([tokens[i * seq_len: i * seq_len + seq_len + 1] for i in ids]))
        yield {"input_ids": block[:, :-1], "targets": block[:, 1:]}
