"""One resumable sampler behind every objective and task.

A plug-in describes its data as a `Source`: how many examples an epoch has and how to build a batch
from example indices. The sampler owns everything else, once: each epoch's shuffled order (from
seed and epoch), length grouping, the global batch of batch_size x processes sliced per rank, the
position saved in checkpoints, and each example's own random stream (from seed, epoch and its
position in the epoch), which is what masking, span noise or crops draw from. Because randomness
follows the example and not the process, the data a run sees does not depend on how many
processes share it, and a resumed run continues exactly.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
from torch import Tensor

from ..errors import UserError

HELD_OUT = 2**31  # the epoch number in held-out examples' random streams: never a training epoch


@dataclass(frozen=True)
class Draw:
    """The examples of one batch: their epoch, their index in that epoch's data, and the key of
    each one's random stream."""

    epochs: np.ndarray  # (B,) int64
    indices: np.ndarray  # (B,) int64
    keys: np.ndarray  # (B, 3) int64: (seed, epoch, position in the epoch)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, rows: slice) -> Draw:
        return Draw(self.epochs[rows], self.indices[rows], self.keys[rows])

    def rng(self, i: int) -> np.random.Generator:
        """Example i's own random generator: the same for the same example of the same epoch."""
        return np.random.default_rng(self.keys[i].tolist())


class Source:
    """What a plug-in's data gives the sampler. Subclasses set `epoch_size` and `batch`."""

    shuffle: bool = True  # False: index order (a source drawing its own random examples)
    lengths: np.ndarray | None = None  # per-example lengths: batches of similar length

    def epoch_size(self, epoch: int) -> int:
        raise NotImplementedError

    def batch(self, draw: Draw) -> dict[str, Tensor]:
        raise NotImplementedError


def grouped_order(lengths: np.ndarray, rng: np.random.Generator, batch: int, group: int = 50) -> np.ndarray:
    """transformers' LengthGroupedSampler: a random order cut into mega-batches of `group` batches,
    each sorted by length, then the batches shuffled; a last partial batch stays last."""
    order = rng.permutation(len(lengths))
    parts = np.array_split(order, max(1, math.ceil(len(order) / (batch * group))))
    order = np.concatenate([p[np.argsort(-lengths[p], kind="stable")] for p in parts])
    full = len(order) // batch
    batches = order[: full * batch].reshape(full, batch)[rng.permutation(full)]
    return np.concatenate([batches.reshape(-1), order[full * batch :]])


def micro_slices(batch_size: int, micro_batch: int) -> list[slice]:
    """The rows of each micro-batch of a batch (train.micro_batch_size; 0: the batch whole)."""
    step = micro_batch or batch_size
    return [slice(s, s + step) for s in range(0, batch_size, step)]


class Sampler:
    """Resumable batches from a Source: the global batch of batch_size * world_size examples in a
    fresh seeded order each epoch, this rank's slice of it, epochs joined end to end. With
    micro_batch, each batch comes as batch_size / micro_batch batches of its rows in turn (the same
    examples and order as whole batches: a step accumulates them)."""

    def __init__(
        self, source: Source, batch_size: int, seed: int, rank: int = 0, world_size: int = 1, micro_batch: int = 0
    ):
        self.source, self.batch_size, self.seed = source, batch_size, seed
        self.rank, self.world_size = rank, world_size
        self.micro_batch = micro_batch
        self.epoch, self.index = 0, 0  # the next example: position `index` of epoch `epoch`
        self._orders: dict[int, np.ndarray | None] = {}
        self._pending: list[Draw] = []  # the rest of the current batch's micro-batches

    def _order(self, epoch: int) -> np.ndarray | None:
        """Epoch `epoch`'s example order (None: index order), cached for the current epochs."""
        if epoch not in self._orders:
            n, order = self.source.epoch_size(epoch), None
            if self.source.shuffle:
                rng = np.random.default_rng([self.seed, epoch])
                lengths = self.source.lengths
                order = (
                    rng.permutation(n)
                    if lengths is None
                    else grouped_order(lengths, rng, self.batch_size * self.world_size)
                )
            self._orders = {e: o for e, o in self._orders.items() if e >= epoch - 1}
            self._orders[epoch] = order
        return self._orders[epoch]

    def draw(self) -> Draw:
        """The next global batch's examples (advancing the position), before the rank slice."""
        need = self.batch_size * self.world_size
        epochs, indices, positions = [], [], []
        while need:
            n = self.source.epoch_size(self.epoch)
            if n <= 0:
                raise UserError("the training data has no examples (too short for a single block or pair?)")
            if self.index >= n:
                self.epoch, self.index = self.epoch + 1, 0
                continue
            take = min(need, n - self.index)
            pos = np.arange(self.index, self.index + take)
            order = self._order(self.epoch)
            indices.append(pos if order is None else order[pos])
            epochs.append(np.full(take, self.epoch))
            positions.append(pos)
            self.index, need = self.index + take, need - take
        epochs_, positions_ = np.concatenate(epochs), np.concatenate(positions)
        keys = np.stack([np.full_like(epochs_, self.seed), epochs_, positions_], axis=1)
        return Draw(epochs_, np.concatenate(indices), keys)

    def next_batch(self) -> dict[str, Tensor]:
        if not self._pending:
            mine = self.draw()[self.rank * self.batch_size : (self.rank + 1) * self.batch_size]
            self._pending = [mine[rows] for rows in micro_slices(len(mine), self.micro_batch)]
        return self.source.batch(self._pending.pop(0))

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict) -> None:
        if "epoch" not in state:
            raise UserError(
                "this checkpoint was written by a run that streamed its data; resume it with data.streaming true"
            )
        self.epoch, self.index = int(state["epoch"]), int(state["index"])


class Stream:
    """A source read in order rather than indexed (a streamed dataset): it hands out the next examples
    of the global stream, builds batches from them, and saves its own position."""

    def next_examples(self, n: int) -> list:
        raise NotImplementedError

    def batch(self, examples: list, rngs: list) -> dict[str, Tensor]:
        raise NotImplementedError

    def state_dict(self) -> dict:
        raise NotImplementedError

    def load_state_dict(self, state: dict) -> None:
        raise NotImplementedError


STREAM_EPOCH = 2**30  # the epoch number in streamed examples' random streams


class StreamSampler:
    """The Sampler's counterpart for a Stream: every rank reads the global batch of batch_size x
    processes and keeps its slice; example k of the stream draws from (seed, STREAM_EPOCH, k)."""

    def __init__(
        self, stream: Stream, batch_size: int, seed: int, rank: int = 0, world_size: int = 1, micro_batch: int = 0
    ):
        self.stream, self.batch_size, self.seed, self.rank, self.world_size = stream, batch_size, seed, rank, world_size
        self.micro_batch = micro_batch
        self.consumed = 0
        self._pending: list[tuple[list, list]] = []  # the rest of the current batch's micro-batches

    def next_batch(self) -> dict[str, Tensor]:
        if not self._pending:
            examples = self.stream.next_examples(self.batch_size * self.world_size)
            first = self.consumed + self.rank * self.batch_size
            self.consumed += len(examples)
            mine = examples[self.rank * self.batch_size : (self.rank + 1) * self.batch_size]
            rngs = [np.random.default_rng([self.seed, STREAM_EPOCH, first + i]) for i in range(len(mine))]
            self._pending = [(mine[rows], rngs[rows]) for rows in micro_slices(len(mine), self.micro_batch)]
        return self.stream.batch(*self._pending.pop(0))

    def state_dict(self) -> dict:
        return {"consumed": self.consumed, "stream": self.stream.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if "stream" not in state:
            raise UserError(
                "this checkpoint was written by a run that did not stream its data; resume it with data.streaming false"
            )
        self.consumed = int(state["consumed"])
        self.stream.load_state_dict(state["stream"])


def make_sampler(source, batch_size: int, seed: int, rank: int = 0, world_size: int = 1, micro_batch: int = 0):
    """The sampler for a plug-in's training data: indexed Sources and Streams alike."""
    cls = StreamSampler if isinstance(source, Stream) else Sampler
    return cls(source, batch_size, seed, rank, world_size, micro_batch)


class PaddingBatch(dict):
    """A held-out batch that only keeps a rank in step with the others: under FSDP every forward is a
    collective, so every rank runs as many held-out batches as rank 0; its metrics are not counted."""


def sequential_batches(
    source: Source, batch_size: int, seed: int, max_batches: int = 0, rank: int = 0, world_size: int = 1
) -> Iterator[dict[str, Tensor]]:
    """Held-out batches: examples 0, 1, 2, ... of epoch 0 in order, each with the same random
    stream every time, so evaluations compare (max_batches 0: every example once). Every rank gets
    the same number of batches: a rank whose share of the last global batch is empty gets a
    PaddingBatch (the first examples again) to run and not count."""
    n = source.epoch_size(0)
    per_step = batch_size * world_size
    n_batches = math.ceil(n / per_step)
    if max_batches > 0:
        n_batches = min(n_batches, max_batches)
    for b in range(n_batches):
        first = b * per_step + rank * batch_size
        idx = np.arange(first, min(first + batch_size, n))
        padding = not len(idx)
        if padding:
            idx = np.arange(min(batch_size, n))
        keys = np.stack([np.full_like(idx, seed), np.full_like(idx, HELD_OUT), idx], axis=1)
        batch = source.batch(Draw(np.zeros_like(idx), idx, keys))
        yield PaddingBatch(batch) if padding else batch
