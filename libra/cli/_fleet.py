"""Where generation calls go: the ``--server`` option turned into endpoints and a client.

``emulated`` runs the emulated OpenAI server in-process (through ``httpx.ASGITransport``,
no sockets); a URL, or several separated by commas, names any OpenAI-compatible servers.
This is the one place that composes a fleet: runtime code only ever sees endpoints and
an HTTP client.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import httpx
import msgspec

from libra.emulation import EmulatorConfig, create_app
from libra.engine import HTTPTransport, TransportError, TransportName, http_transport
from libra.sched import Endpoint


class FleetError(RuntimeError):
    """The servers named by ``--server`` cannot be used; the message says why."""


@dataclass
class Fleet:
    http: HTTPTransport
    endpoints: list[Endpoint]


class _Models(msgspec.Struct):
    data: list[dict[str, object]]


@asynccontextmanager
async def open_fleet(
    server: str,
    *,
    model: str | None,
    transport: TransportName,
    max_connections: int,
    emulator: EmulatorConfig | None = None,
) -> AsyncIterator[Fleet]:
    if server == "emulated":
        config = emulator or EmulatorConfig()
        app = create_app(config)
        async with http_transport(httpx.ASGITransport(app=app)) as http:
            yield Fleet(http, [Endpoint("http://emulated", model=model or config.model_name)])
        return
    urls = [url.strip() for url in server.split(",") if url.strip()]
    if not all(url.startswith(("http://", "https://")) for url in urls):
        raise FleetError(f"--server must be 'emulated' or http(s) URLs, got {server!r}")
    async with http_transport(transport, max_connections=max_connections) as http:
        endpoints = [Endpoint(url, model=model or await _first_model(http, url)) for url in urls]
        yield Fleet(http, endpoints)


async def _first_model(http: HTTPTransport, url: str) -> str:
    """The model a server serves, for requests that must name one."""
    try:
        status, content = await http.get(url.rstrip("/") + "/v1/models", timeout_s=10)
        if status != 200:
            raise FleetError(f"{url}/v1/models answered HTTP {status}")
        models = msgspec.json.decode(content, type=_Models).data
    except (TransportError, msgspec.DecodeError) as exc:
        raise FleetError(f"cannot list the models of {url}: {exc}") from None
    if not models or not isinstance(models[0].get("id"), str):
        raise FleetError(f"{url}/v1/models lists no model; pass --model")
    return str(models[0]["id"])
