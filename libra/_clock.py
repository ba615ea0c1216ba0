"""The event loop's clock, read cheaply.

``anyio.current_time()`` finds the running backend on every call, and on asyncio even
``asyncio.get_running_loop()`` makes a system call (``getpid``, to catch a forked
child): a few microseconds where a gateway request read the clock about ten times.
asyncio's loops (uvloop's too, at millisecond resolution) read the monotonic clock,
read here directly; under trio (and its virtual clocks in tests), trio's clock.

Whether trio runs in this thread is read from ``sniffio.thread_local.name``, which trio
sets to ``"trio"`` for the length of its run (sniffio is one of trio's dependencies):
asking trio instead (``trio.current_time()`` raising ``RuntimeError``, or
``trio.lowlevel.in_trio_run()``) cost 1-2 µs a call outside trio, in every process that
had merely imported it.
"""

from __future__ import annotations

import sys
import time
from typing import Any


class _NoTrio:
    name = None


_running: Any
try:
    from sniffio import thread_local as _running
except ImportError:  # no sniffio, so no trio either
    _running = _NoTrio()


def now() -> float:
    """The running event loop's clock, in seconds: ``anyio.current_time()`` (to within
    uvloop's millisecond resolution)."""
    if _running.name == "trio":
        return float(sys.modules["trio"].current_time())
    return time.monotonic()
