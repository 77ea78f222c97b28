"""From a token store to fixed-length blocks: the held-out split on the stored stream, and block
sources the one sampler shuffles, slices per rank and resumes.

Blocks are read from the store per batch (only the tokens of a batch are ever read). With `document_mask`, each block also carries its tokens' document numbers: the model
then attends within a document only (block-diagonal causal attention), learned positions restart
at each document, and the target that would cross into the next document is not scored, so a
packed block's loss is the loss of its documents run alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..errors import UserError
from . import IGNORE
from .sampler import Draw, Source
from .store import TokenStore


@dataclass(frozen=True)
class TokenSpan:
    """A contiguous run of a store's tokens (the training part or the held-out part)."""

    store: TokenStore
    start: int
    stop: int

    @property
    def tokens(self):
        return self.store.tokens.view(self.start, self.stop)  # nothing read yet

    def __len__(self) -> int:
        return self.stop - self.start

    def documents(self, positions: np.ndarray) -> np.ndarray:
        """The document number of each position (relative to this span)."""
        return np.searchsorted(self.store.doc_ends, self.start + positions, side="right")


def split_stores(
    train: TokenStore, val: TokenStore | None, val_fraction: float, block: int
) -> tuple[TokenSpan, TokenSpan]:
    """The training span and the held-out span: a separate store (data.val_source), or the last
    `val_fraction` of the training stream (contiguous, so no block straddles the split)."""
    if val is not None:
        train_span, val_span = TokenSpan(train, 0, len(train)), TokenSpan(val, 0, len(val))
    else:
        n_val = int(len(train) * val_fraction)
        cut = len(train) - n_val
        train_span, val_span = TokenSpan(train, 0, cut), TokenSpan(train, cut, len(train))
    if len(train_span) < block + 1:
        raise UserError(f"training data has {len(train_span)} tokens, fewer than one block of {block + 1}")
    if val is None and val_fraction > 0 and len(val_span) < block + 1:
        raise UserError(
            f"held-out data has {len(val_span)} tokens, fewer than one block of {block + 1}; "
            f"raise data.val_fraction or give data.val_source"
        )
    return train_span, val_span


class BlockSource(Source):
    """Hugging Face's group_texts: non-overlapping blocks of seq_len + 1 tokens (inputs and the
    targets one to the right). With shift=True each epoch starts the grid at an offset drawn from
    (seed, epoch), so every epoch sees new block boundaries. `span` may be a TokenSpan (a store)
    or a plain array of ids."""

    def __init__(self, span, seq_len: int, seed: int = 0, shift: bool = True, document_mask: bool = False):
        self.span, self.seq_len, self.seed = span, seq_len, seed
        self.tokens = span.tokens if isinstance(span, TokenSpan) else np.asarray(span)
        self.shift = shift and len(self.tokens) > 2 * (seq_len + 1)
        if document_mask and not isinstance(span, TokenSpan):
            raise ValueError("document_mask needs a token store (document boundaries)")
        self.document_mask = document_mask

    def offset(self, epoch: int) -> int:
        return int(np.random.default_rng([self.seed, epoch, 7]).integers(0, self.seq_len)) if self.shift else 0

    def epoch_size(self, epoch: int) -> int:
        return max(0, (len(self.tokens) - self.offset(epoch) - 1) // self.seq_len)

    def starts(self, draw: Draw) -> list[int]:
        return [self.offset(int(e)) + int(i) * self.seq_len for e, i in zip(draw.epochs, draw.indices)]

    def blocks(self, starts: list[int]) -> torch.Tensor:
        """(B, seq_len + 1) int64 token blocks beginning at `starts` (read from the store now)."""
        rows = np.stack([self.tokens[s : s + self.seq_len + 1] for s in starts]).astype(np.int64)
        return torch.from_numpy(rows)

    def batch(self, draw: Draw) -> dict[str, torch.Tensor]:
        starts = self.starts(draw)
        block = self.blocks(starts)
        out = {"input_ids": block[:, :-1], "targets": block[:, 1:]}
        if self.document_mask:
            docs = np.stack([self.span.documents(np.arange(s, s + self.seq_len + 1)) for s in starts])
            out = within_documents(out, torch.from_numpy(docs))
        return out


def within_documents(pair: dict[str, torch.Tensor], docs: torch.Tensor) -> dict[str, torch.Tensor]:
    """data.document_mask for a shifted pair: `docs` (B, T + 1) numbers each token's document; the
    inputs get their doc_ids (B, T) and a target in another document than its input is ignored."""
    return {
        **pair,
        "doc_ids": docs[:, :-1],
        "targets": pair["targets"].masked_fill(docs[:, 1:] != docs[:, :-1], IGNORE),
    }


def documents_from_eos(blocks: np.ndarray, eos: int) -> np.ndarray:
    """(B, L) blocks of a stream whose documents each end with `eos` -> (B, L) document numbers
    (an end-of-text token belongs to the document it ends; numbers restart in every block)."""
    ends = blocks[:, :-1] == eos
    return np.concatenate([np.zeros((len(blocks), 1), dtype=np.int64), np.cumsum(ends, axis=1)], axis=1)


class WindowSource(BlockSource):
    """nanoGPT's get_batch: each example is a window at a position drawn from its own random stream
    (more variety per token on small corpora). An 'epoch' is as many windows as the stream has blocks."""

    shuffle = False

    def __init__(self, span, seq_len: int, document_mask: bool = False):
        super().__init__(span, seq_len, shift=False, document_mask=document_mask)

    def starts(self, draw: Draw) -> list[int]:
        last = len(self.tokens) - self.seq_len - 1
        return [int(draw.rng(i).integers(0, last, endpoint=True)) for i in range(len(draw))]
