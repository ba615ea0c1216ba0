"""The client's shared probes of a server."""

from __future__ import annotations

import anyio
import httpx
import pytest

from libra._asgi import Receive, Scope, Send
from libra.emulation import EmulatorConfig, LatencyModel, create_app
from libra.engine import OpenAIClient, ServerUnavailable, http_transport
from libra.engine._client import ProbeCache
from libra.engine._config import TurnSampling
from libra.fleet import Endpoint
from libra.openai import Message
from tests._helpers import MODEL

pytestmark = pytest.mark.anyio


async def test_concurrent_callers_share_a_probes_failure_then_probe_again() -> None:
    cache: ProbeCache[str, bool] = ProbeCache()
    probes, errors = 0, 0

    async def probe() -> bool:
        nonlocal probes
        probes += 1
        await anyio.sleep(0.001)
        if probes == 1:
            raise ServerUnavailable("down")
        return True

    async def ask() -> None:
        nonlocal errors
        try:
            await cache.get("server", probe)
        except ServerUnavailable:
            errors += 1

    async with anyio.create_task_group() as group:
        for _ in range(8):
            group.start_soon(ask)
    assert (probes, errors) == (1, 8)
    assert await cache.get("server", probe) and probes == 2


@pytest.mark.anyio
@pytest.mark.parametrize("session_header", [None, "X-Libra-Session"])
async def test_a_call_names_its_trajectory_where_the_endpoint_asks(
    session_header: str | None,
) -> None:
    """A gateway's endpoint gets each generation call's trajectory key in its header."""
    seen: list[dict[bytes, bytes]] = []
    emulator = create_app(EmulatorConfig(latency=LatencyModel.zero()))

    async def server(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            seen.append(dict(scope["headers"]))
        await emulator(scope, receive, send)

    endpoint = Endpoint("http://emulated", model=MODEL, session_header=session_header)
    sampling = TurnSampling(8, 1.0, 1.0, None, None, session="traj-7")
    async with http_transport(httpx.ASGITransport(app=server)) as http:
        client = OpenAIClient(http)
        await client.complete(endpoint, list(b"Once upon a time"), sampling)
        await client.chat(endpoint, [Message(role="user", content="Hi")], None, sampling)
    named = [headers.get(b"x-libra-session") for headers in seen]
    assert named == ([b"traj-7"] * 2 if session_header else [None, None])
