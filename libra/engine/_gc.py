"""Fewer cyclic garbage collections while a rollout runs.

Each generation call allocates a few dozen objects the cyclic collector tracks
(coroutines, the dataclasses of routing and records, the HTTP call's state), so
CPython's default young-generation threshold (700 allocations) ran a collection every
dozen or so calls: about a tenth of the engine's CPU at 1,000 concurrent trajectories
(``libra bench engine``), for garbage that is nearly all freed by reference counting
anyway; and at 10,000 trajectories the survivors (their live state) made the middle
generation's collections as costly. While any rollout session is open both thresholds
are raised (the oldest generation's is kept); the last session to close puts the old
ones back.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

YOUNG_THRESHOLD = 20_000
MIDDLE_THRESHOLD = 100  # young collections per middle one


class _Raised:
    """How many sessions hold the raised threshold, and what it replaced."""

    holders = 0
    replaced: tuple[int, int, int] | None = None


@contextmanager
def fewer_collections() -> Iterator[None]:
    young, older, oldest = gc.get_threshold()
    if _Raised.holders == 0 and 0 < young < YOUNG_THRESHOLD:  # 0: collection is off
        _Raised.replaced = (young, older, oldest)
        gc.set_threshold(YOUNG_THRESHOLD, max(older, MIDDLE_THRESHOLD), oldest)
    _Raised.holders += 1
    try:
        yield
    finally:
        _Raised.holders -= 1
        replaced = _Raised.replaced
        # Put it back unless someone set their own threshold meanwhile.
        if _Raised.holders == 0 and replaced is not None:
            if gc.get_threshold()[0] == YOUNG_THRESHOLD:
                gc.set_threshold(*replaced)
            _Raised.replaced = None
