"""Streamed text (data.streaming): documents read in order from their source (a Hugging Face dataset
with streaming=True, or local files of any size), tokenized as they arrive, cut into blocks and
shuffled through a buffer of data.shuffle_buffer blocks. Nothing is tokenized ahead of time and
nothing but the buffer is held.

The stream's state (its epoch, how many document pieces it has read, the tokens left over after the
last block, the buffer and its random generator) is saved in every checkpoint, so a resumed run
continues where the stream was, with the same buffer and the same draws: bit for bit. Resuming
skips the pieces already read (reading them again, not tokenizing them). Every process reads the
whole stream and keeps its slice of each global batch, so the order does not depend on the number
of processes. The stream's first blocks are the evaluation set (not trained on in the first pass).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator

import numpy as np

from ..errors import UserError
from .documents import DocumentSource
from .sampler import Draw, Source, Stream
from .tokenizers import TextTokenizer

TOKENIZE_CHARS = 1 << 18  # characters tokenized at a time


class BlockStream(Stream):
    """Blocks of `block_len` tokens of a document stream, through a seeded shuffle buffer; `make_batch`
    turns (B, block_len) int64 blocks and their random generators into a batch."""

    def __init__(
        self,
        source: DocumentSource,
        tokenizer: TextTokenizer,
        block_len: int,
        buffer_size: int,
        seed: int,
        make_batch: Callable[[np.ndarray, list], dict],
        held_out: int = 0,
    ):
        self.source, self.tok, self.block_len, self.buffer_size = source, tokenizer, block_len, buffer_size
        self.make_batch, self.held_out = make_batch, held_out
        self.eos = tokenizer.eos_id
        self.epoch, self.pieces_read, self.carry = 0, 0, np.zeros(0, dtype=np.int64)
        self.buffer: list[np.ndarray] = []
        self.rng = np.random.default_rng([seed, 23])
        self._pieces: Iterator | None = None
        self._skipped_held_out = False

    # --- reading -----------------------------------------------------------------------------
    def _open(self) -> Iterator:
        """The source's pieces from where this stream is (the pieces already read skipped)."""
        return itertools.islice(self.source.pieces(), self.pieces_read, None)

    def _tokenize_more(self) -> bool:
        """Append the next pieces' ids to the carry; False at the end of the source (a new epoch starts)."""
        if self._pieces is None:
            self._pieces = self._open()
        texts, ends, size = [], [], 0
        for text, end in self._pieces:
            texts.append(text)
            ends.append(end)
            size += len(text)
            if size >= TOKENIZE_CHARS:
                break
        if not texts:
            return False
        self.pieces_read += len(texts)
        ids = [
            e + ([self.eos] if end and self.eos is not None else [])
            for e, end in zip(self.tok.encode_batch(texts), ends)
        ]
        self.carry = np.concatenate([self.carry, np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int64)])
        return True

    def _raw_block(self) -> np.ndarray:
        """The next block in stream order (epochs follow each other)."""
        while len(self.carry) < self.block_len:
            if not self._tokenize_more():
                if self.pieces_read == 0:
                    raise UserError(f"{self.source.spec}: no text to stream")
                self.epoch, self.pieces_read, self._pieces = self.epoch + 1, 0, None
        block, self.carry = self.carry[: self.block_len], self.carry[self.block_len :]
        return block

    def first_blocks(self, n: int) -> list[np.ndarray]:
        """The first n blocks of the stream, in order (the held-out set)."""
        return [self._raw_block() for _ in range(n)]

    # --- Stream -------------------------------------------------------------------------------
    def next_examples(self, n: int) -> list[np.ndarray]:
        if not self._skipped_held_out and self.epoch == 0 and self.pieces_read == 0 and not len(self.carry):
            self.first_blocks(self.held_out)  # held out, never trained on
        self._skipped_held_out = True
        while len(self.buffer) < self.buffer_size:
            self.buffer.append(self._raw_block())
        out = []
        for _ in range(n):
            j = int(self.rng.integers(len(self.buffer)))
            out.append(self.buffer[j])
            self.buffer[j] = self._raw_block()
        return out

    def batch(self, examples: list[np.ndarray], rngs: list) -> dict:
        return self.make_batch(np.stack(examples), rngs)

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "pieces_read": self.pieces_read,
            "carry": self.carry,
            "buffer": np.stack(self.buffer) if self.buffer else np.zeros((0, self.block_len), np.int64),
            "rng": self.rng.bit_generator.state,
            "skipped_held_out": self._skipped_held_out,
        }

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.pieces_read = int(state["epoch"]), int(state["pieces_read"])
        self.carry = np.asarray(state["carry"], dtype=np.int64)
        self.buffer = [np.asarray(b, dtype=np.int64) for b in state["buffer"]]
        self.rng.bit_generator.state = state["rng"]
        self._skipped_held_out, self._pieces = bool(state["skipped_held_out"]), None


class ListSource(Source):
    """A few blocks held in memory (a stream's held-out set), batched in order."""

    shuffle = False

    def __init__(self, blocks: list[np.ndarray], make_batch: Callable[[np.ndarray, list], dict]):
        self.blocks, self.make_batch = blocks, make_batch

    def epoch_size(self, epoch: int) -> int:
        return len(self.blocks)

    def batch(self, draw: Draw) -> dict:
        rows = np.stack([self.blocks[int(i)] for i in draw.indices])
        return self.make_batch(rows, [draw.rng(i) for i in range(len(draw))])


def stream_sources(
    source: DocumentSource,
    tokenizer: TextTokenizer,
    block_len: int,
    data,
    train_cfg,
    make_batch: Callable[[np.ndarray, list], dict],
) -> tuple[BlockStream, ListSource | None]:
    """The training stream and its held-out blocks (the stream's first eval_batches x batch_size)."""
    held = train_cfg.eval_batches * train_cfg.batch_size
    val = ListSource(BlockStream(source, tokenizer, block_len, 1, 0, make_batch).first_blocks(held), make_batch)
    return BlockStream(source, tokenizer, block_len, data.shuffle_buffer, train_cfg.seed, make_batch, held), val
