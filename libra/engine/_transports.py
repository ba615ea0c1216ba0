"""The engine's transports by name: ``http_transport``."""

from __future__ import annotations

from typing import Literal

import httpx

from libra.engine._http import AiohttpTransport, HTTPTransport, HttpxTransport
from libra.engine._httptools import HttptoolsTransport

TransportName = Literal["httptools", "aiohttp", "httpx"]


def http_transport(
    transport: TransportName | httpx.AsyncBaseTransport = "httptools",
    *,
    max_connections: int = 1024,
) -> HTTPTransport:
    """The engine's HTTP transport: by name for real ports, or over an httpx transport
    (e.g. ``httpx.ASGITransport(app=...)`` for an in-process fleet)."""
    if transport == "httptools":
        return HttptoolsTransport(max_connections)
    if transport == "aiohttp":
        return AiohttpTransport(max_connections)
    if transport == "httpx":
        limits = httpx.Limits(max_connections=max_connections)
        return HttpxTransport(httpx.AsyncClient(limits=limits))
    return HttpxTransport(httpx.AsyncClient(transport=transport))
