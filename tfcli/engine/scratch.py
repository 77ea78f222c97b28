"""What the memory plan's probes must know of the objectives' scratch work, told from below.

The fused loss (objectives/losses.py) loops over a large vocabulary in tiles of the same shapes and
keeps one reused buffer of logits. The memory plan (memory.py) runs probe steps through it: it lets
the loop's repeats allocate without computing, and gives the buffer back once the probes are done.
The engine sits below the objectives, so the objectives say both here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

_repeating = [0]  # > 0 while a loop of same-shaped ops runs
_releases: list[Callable[[], None]] = []


@contextlib.contextmanager
def repeated_ops() -> Iterator[None]:
    """Mark a loop whose ops repeat the same shapes (a loss's pass over a vocabulary's tiles)."""
    _repeating[0] += 1
    try:
        yield
    finally:
        _repeating[0] -= 1


def in_repeated_ops() -> bool:
    """Whether the op being run is one of a repeated_ops loop."""
    return _repeating[0] > 0


def releases_after_probes(release: Callable[[], None]) -> Callable[[], None]:
    """Register a function that gives a reused buffer back (decorator)."""
    _releases.append(release)
    return release


def release_buffers() -> None:
    """Give every registered reused buffer back (the memory plan, once its probes have run)."""
    for release in _releases:
        release()
