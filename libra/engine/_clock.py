"""anyio's clock, read without looking up the event loop's backend on every read.

``anyio.current_time()`` finds the running backend each time (sniffio, which asks
asyncio for the current task): about 1.5 µs, against 0.3 µs for the loop's own clock,
and the engine reads the clock several times per generation call. On asyncio, anyio's
clock *is* the running loop's ``time()``; elsewhere (trio, its mock clock in tests)
this is anyio's own read.
"""

from __future__ import annotations

import asyncio

import anyio


def now() -> float:
    """The current time on anyio's clock (virtual under a mock clock)."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # not on asyncio
        return anyio.current_time()
    return loop.time()
