"""libra serve's uvicorn protocol: each answer in one socket write, the same bytes; a
client's disconnect reported through the ``libra.disconnect`` extension."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest
import uvicorn

from libra._asgi import on_disconnect
from libra.cli._http_protocol import ServeHttpToolsProtocol

pytestmark = pytest.mark.anyio

BODY = b'{"answer": 42}'
LEFT: list[str] = []  # the paths whose client went away before their answer
RELEASE = anyio.Event()  # (re-made by the test that waits on it)


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Answers ``/close`` with ``connection: close``, ``/wait`` once ``RELEASE`` is set,
    anything else at once and kept alive; notes its disconnected clients in ``LEFT``."""
    assert scope["type"] == "http"
    assert on_disconnect(scope, lambda: LEFT.append(scope["path"]))
    await receive()
    if scope["path"] == "/wait":
        await RELEASE.wait()
    headers = [(b"content-type", b"application/json"), (b"content-length", b"14")]
    if scope["path"] == "/close":
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": BODY})


@asynccontextmanager
async def serving() -> AsyncIterator[int]:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    config = uvicorn.Config(app, http=ServeHttpToolsProtocol, lifespan="off", log_level="warning")
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


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_an_answer_arrives_whole_in_one_read_and_the_connection_lives_on() -> None:
    async with serving() as port, await anyio.connect_tcp("127.0.0.1", port) as client:
        for _ in range(3):  # kept alive: the next request on the same connection
            await client.send(request("/"))
            with anyio.fail_after(5):
                answer = await client.receive()
            head, _, body = answer.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200 OK") and b"content-length: 14" in head
            assert body == BODY  # in the same read as the headers: written once


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
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


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_client_gone_before_its_answer_is_reported_to_the_app() -> None:
    global RELEASE
    RELEASE = anyio.Event()
    LEFT.clear()
    async with serving() as port:
        async with await anyio.connect_tcp("127.0.0.1", port) as client:
            await client.send(request("/"))  # answered: its close is no news
            with anyio.fail_after(5):
                await client.receive()
        async with await anyio.connect_tcp("127.0.0.1", port) as client:
            await client.send(request("/wait"))
            await anyio.sleep(0.2)  # (the app is waiting)
        with anyio.fail_after(5):
            while not LEFT:
                await anyio.sleep(0.01)
        RELEASE.set()
    assert LEFT == ["/wait"]
