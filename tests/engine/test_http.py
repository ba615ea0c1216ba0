"""The engine's HTTP transports over a real port: answers, and failures as TransportError."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import msgspec
import pytest

from libra.emulation import EmulatorConfig, LatencyModel, running_emulator
from libra.engine import TransportError, TransportName, TransportTimeout, http_transport
from libra.openai import TokenizeResponse
from tests._helpers import MODEL

pytestmark = [pytest.mark.anyio, pytest.mark.parametrize("name", ["httptools", "aiohttp", "httpx"])]
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"  # aiohttp is asyncio-only


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    """An emulated server whose decode steps take 50 ms each."""
    slow_steps = LatencyModel(prefill_s_per_token=0.0, step_base_s=0.05)
    with running_emulator(EmulatorConfig(latency=slow_steps)) as url:
        yield url


async def test_posts_and_gets_bring_back_the_status_and_body(url: str, name: TransportName) -> None:
    body = msgspec.json.encode({"model": MODEL, "prompt": "hi"})
    async with http_transport(name) as http:
        status, answer = await http.post(f"{url}/tokenize", body, JSON, 10.0)
        health = await http.get(f"{url}/health", 10.0)
        missing = await http.get(f"{url}/v1/nothing", 10.0)
    assert status == 200
    assert msgspec.json.decode(answer, type=TokenizeResponse).tokens == list(b"hi")
    assert (health[0], missing[0]) == (200, 404)


async def test_a_refused_connection_is_a_transport_error(name: TransportName) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, never listening: connections are refused
        async with http_transport(name) as http:
            with pytest.raises(TransportError):
                await http.get(f"http://127.0.0.1:{port}/health", 10.0)


async def test_a_call_that_outlasts_its_timeout_is_a_transport_timeout(
    url: str, name: TransportName
) -> None:
    body = msgspec.json.encode({"model": MODEL, "prompt": "What is 12 times 7 plus 3?"})
    async with http_transport(name) as http:
        with pytest.raises(TransportTimeout, match=r"no answer within 0\.2 s"):
            await http.post(f"{url}/v1/completions", body, JSON, 0.2)  # replies take ~1 s
