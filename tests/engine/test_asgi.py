"""The in-process ASGI transport: the engine's two calls handed straight to an app."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from libra.emulation import EmulatorConfig, LatencyModel, create_app
from libra.engine import ASGITransport, TransportError
from libra.openai import TokenizeResponse
from tests._helpers import MODEL

pytestmark = pytest.mark.anyio
JSON = {"content-type": "application/json"}


async def test_posts_and_gets_reach_the_app_and_bring_its_answer_back() -> None:
    app = create_app(EmulatorConfig(latency=LatencyModel.zero()))
    body = msgspec.json.encode({"model": MODEL, "prompt": "hi"})
    async with ASGITransport(app) as http:
        status, answer = await http.post("http://emulated/tokenize", body, JSON, 5.0)
        health = await http.get("http://emulated/health", 5.0)
        missing = await http.get("http://emulated/v1/nothing", 5.0)
    assert status == 200
    assert msgspec.json.decode(answer, type=TokenizeResponse).tokens == list(b"hi")
    assert health[0] == 200
    assert missing[0] == 404  # an HTTP error is an answer, not a transport failure


async def test_a_call_that_outlasts_its_timeout_is_a_transport_error() -> None:
    slow = LatencyModel(prefill_s_per_token=0.0, step_base_s=0.05)
    app = create_app(EmulatorConfig(latency=slow))
    body = msgspec.json.encode({"model": MODEL, "prompt": "x", "max_tokens": 100})
    async with ASGITransport(app) as http:
        with pytest.raises(TransportError, match=r"no answer within 0\.1 s"):
            await http.post("http://emulated/v1/completions", body, JSON, 0.1)
    assert app.engine is not None and app.engine.num_running == 0


async def test_a_server_that_is_not_there_or_never_answers_is_a_transport_error() -> None:
    async def unreachable(scope: Any, receive: Any, send: Any) -> None:
        raise ConnectionRefusedError("no route to host")

    async def silent(scope: Any, receive: Any, send: Any) -> None:
        await receive()

    async with ASGITransport(unreachable) as http:
        with pytest.raises(TransportError, match="no route to host"):
            await http.get("http://gone/health", 5.0)
    async with ASGITransport(silent) as http:
        with pytest.raises(TransportError, match="sent no response"):
            await http.post("http://mute/v1/completions", b"{}", JSON, 5.0)


async def test_the_request_reaches_the_app_whole_and_a_chunked_answer_comes_back_whole() -> None:
    seen: dict[str, Any] = {}

    async def echo(scope: Any, receive: Any, send: Any) -> None:
        message = await receive()
        seen.update(scope, body=message["body"])
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": b"one ", "more_body": True})
        await send({"type": "http.response.body", "body": message["body"]})

    async with ASGITransport(echo) as http:
        status, answer = await http.post("http://host/v1/x", b"two", {"X-Key": "v"}, 5.0)
    assert (status, answer) == (201, b"one two")
    assert (seen["method"], seen["path"], seen["server"]) == ("POST", "/v1/x", ("host", 80))
    assert seen["headers"] == [(b"x-key", b"v")] and seen["body"] == b"two"
