"""libra serve's uvicorn protocol: each answer in one socket write, the same bytes; a
client's disconnect reported through the ``libra.disconnect`` extension."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import anyio
import pytest
import uvicorn

from libra._asgi import on_disconnect
from libra.gateway._http_protocol import ServeHttpToolsProtocol

# uvicorn runs on asyncio only.
pytestmark = [pytest.mark.anyio, pytest.mark.parametrize("anyio_backend", ["asyncio"])]

BODY = b'{"answer": 42}'


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Answers ``/close`` with ``connection: close``, anything else kept alive."""
    assert scope["type"] == "http"
    await receive()
    headers = [(b"content-type", b"application/json"), (b"content-length", b"14")]
    if scope["path"] == "/close":
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": BODY})


@asynccontextmanager
async def serving(application: Any = app) -> AsyncIterator[int]:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    config = uvicorn.Config(
        application, http=ServeHttpToolsProtocol, lifespan="off", log_level="warning"
    )
    server = uvicorn.Server(config)
    with listener:
        async with anyio.create_task_group() as group:
            group.start_soon(server.serve, [listener])
            while not server.started:  # noqa: ASYNC110 (uvicorn has only the flag)
                await anyio.sleep(0.01)
            yield listener.getsockname()[1]
            server.should_exit = True


def request(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nhost: test\r\n\r\n".encode()


async def test_an_answer_arrives_whole_in_one_read_and_the_connection_lives_on() -> None:
    async with serving() as port, await anyio.connect_tcp("127.0.0.1", port) as client:
        for _ in range(3):  # kept alive: the next request on the same connection
            await client.send(request("/"))
            with anyio.fail_after(5):
                answer = await client.receive()
            head, _, body = answer.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200 OK") and b"content-length: 14" in head
            assert body == BODY  # in the same read as the headers: written once


async def test_what_is_held_goes_out_before_a_close() -> None:
    async with serving() as port, await anyio.connect_tcp("127.0.0.1", port) as client:
        await client.send(request("/close"))
        received = b""
        with anyio.fail_after(5):
            while True:
                try:
                    received += await client.receive()
                except anyio.EndOfStream:
                    break
        assert received.endswith(b"\r\n\r\n" + BODY) and b"connection: close" in received


async def test_a_client_gone_before_its_answer_is_reported_to_the_app() -> None:
    left: list[str] = []  # the paths whose client went away before their answer
    gone, release = anyio.Event(), anyio.Event()

    def went(path: str) -> None:
        left.append(path)
        gone.set()

    async def waiting(scope: dict[str, Any], receive: Any, send: Any) -> None:
        """``/wait`` answers once released, the rest at once."""
        assert on_disconnect(scope, partial(went, scope["path"]))
        if scope["path"] == "/wait":
            await release.wait()
        await app(scope, receive, send)

    async with serving(waiting) as port:
        async with await anyio.connect_tcp("127.0.0.1", port) as client:
            await client.send(request("/"))  # answered: its close is no news
            with anyio.fail_after(5):
                await client.receive()
        async with await anyio.connect_tcp("127.0.0.1", port) as client:
            await client.send(request("/wait"))
            await anyio.sleep(0.2)  # (the app is waiting)
        with anyio.fail_after(5):
            await gone.wait()
        release.set()
    assert left == ["/wait"]
