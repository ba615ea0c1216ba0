"""The HTTP client the engine generates through, with its transport chosen by measurement.

httpx's API serves the engine well (timeouts, a transport seam for in-process fleets),
but its default transport is the bottleneck on a busy engine: measured here, ~900
requests/s at 16 concurrent and ``ConnectTimeout`` errors at 512, against ~4,800 for the
aiohttp transport (DESIGN.md §4; ``libra bench engine`` measures it again). So real
ports go through aiohttp, and an in-process fleet through ``httpx.ASGITransport``.
"""

from __future__ import annotations

from typing import Literal

import httpx

Transport = Literal["aiohttp", "httpx"]


def http_client(
    transport: Transport | httpx.AsyncBaseTransport = "aiohttp", *, max_connections: int = 1024
) -> httpx.AsyncClient:
    """An ``httpx.AsyncClient`` for the engine.

    ``max_connections`` bounds the sockets open to all servers together; trajectories
    beyond it wait for a free connection instead of overrunning the servers' backlogs.
    """
    limits = httpx.Limits(
        max_connections=max_connections, max_keepalive_connections=max_connections
    )
    if transport == "aiohttp":
        from httpx_aiohttp import AiohttpTransport

        return httpx.AsyncClient(transport=AiohttpTransport(limits=limits))
    if transport == "httpx":
        return httpx.AsyncClient(limits=limits)
    return httpx.AsyncClient(transport=transport)
