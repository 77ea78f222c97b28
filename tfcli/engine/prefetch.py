"""Batches built ahead of time (train.prefetch): a background thread asks the sampler for the next
batches while the model trains on the current one (on a GPU, into pinned memory, so the copy to the
device does not block). The sampler's randomness follows each example, not the thread, so the
batches are exactly those of building them in line; the data position a checkpoint saves is the
one after the last batch the optimizer consumed, not after the last one built.
"""

from __future__ import annotations

import queue
import threading

from torch import Tensor


class Prefetcher:
    """A sampler's batches, `depth` ahead, from a daemon thread."""

    def __init__(self, sampler, depth: int, pin_memory: bool = False):
        self.sampler, self.depth, self.pin = sampler, depth, pin_memory
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._consumed = sampler.state_dict()  # the position after the last batch handed out

    def _work(self) -> None:
        try:
            while not self._stop.is_set():
                batch = self.sampler.next_batch()
                state = self.sampler.state_dict()
                if self.pin:
                    batch = {k: v.pin_memory() if isinstance(v, Tensor) else v for k, v in batch.items()}
                while not self._stop.is_set():
                    try:
                        self._queue.put((batch, state), timeout=0.1)
                        break
                    except queue.Full:
                        continue
        except BaseException as e:  # the main thread re-raises it (a data error, say)
            self._queue.put((e, None))

    def next_batch(self) -> dict:
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="tfcli-prefetch", daemon=True)
            self._thread.start()
        batch, state = self._queue.get()
        if isinstance(batch, BaseException):
            raise batch
        self._consumed = state
        return batch

    def state_dict(self) -> dict:
        return self._consumed

    def load_state_dict(self, state: dict) -> None:
        if self._thread is not None:
            raise RuntimeError("the data position can only be set before the first batch")
        self.sampler.load_state_dict(state)
        self._consumed = self.sampler.state_dict()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            while self._thread.is_alive():
                try:
                    self._queue.get(timeout=0.1)  # let a blocked put see the stop
                except queue.Empty:
                    pass
            self._thread = None
