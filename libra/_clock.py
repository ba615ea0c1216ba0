"""The event loop's clock, read cheaply.

``anyio.current_time()`` finds the running backend on every call, and on asyncio even
``asyncio.get_running_loop()`` makes a system call (``getpid``, to catch a forked
child): a few microseconds where a gateway request read the clock about ten times.
asyncio's loops (uvloop's too, at millisecond resolution) read the monotonic clock,
read here directly; under trio (and its virtual clocks in tests), trio's clock.
"""

from __future__ import annotations

import sys
import time


def now() -> float:
    """The running event loop's clock, in seconds: ``anyio.current_time()`` (to within
    uvloop's millisecond resolution)."""
    trio = sys.modules.get("trio")  # (not imported: not running under trio)
    if trio is not None:
        try:
            return float(trio.current_time())
        except RuntimeError:  # not in trio's thread: asyncio's
            pass
    return time.monotonic()
