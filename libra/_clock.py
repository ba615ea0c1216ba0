"""The event loop's clock, read cheaply.

``anyio.current_time()`` finds the running backend on every call (a few microseconds),
and a gateway request read it about ten times. On asyncio it is the running loop's
``time()``, read here directly; elsewhere (trio, its virtual clocks in tests) anyio's.
"""

from __future__ import annotations

import asyncio

import anyio


def now() -> float:
    """``anyio.current_time()``: the running event loop's clock, in seconds."""
    try:
        return asyncio.get_running_loop().time()
    except RuntimeError:  # no asyncio loop: trio's
        return anyio.current_time()
