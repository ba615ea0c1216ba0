"""HttptoolsTransport's connections against a real, scripted HTTP server on loopback:
kept alive and reused, bounded, dropped when stale or when a call ends without its
answer, and https."""

from __future__ import annotations

import asyncio
import ssl
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import pytest

from libra.engine import HttptoolsTransport, TransportError, TransportTimeout

pytestmark = pytest.mark.anyio
JSON = {"content-type": "application/json"}


@pytest.fixture(params=[pytest.param(False, id="asyncio"), pytest.param(True, id="uvloop")])
def anyio_backend(request: pytest.FixtureRequest) -> tuple[str, dict[str, bool]]:
    """asyncio's protocols: on its own loop, and on uvloop's (``libra serve``'s)."""
    return "asyncio", {"use_uvloop": request.param}


Answer = Callable[[int, int, bytes], Awaitable[bytes | None]]  # (connection, request, body)


@dataclass
class Server:
    """Counts connections and requests; ``answer`` writes each request's reply (None:
    close the connection without one)."""

    answer: Answer
    close_after_answer: bool = False
    url: str = ""
    connections: int = 0
    open_now: int = 0
    most_open: int = 0
    closed_by_client: list[int] = field(default_factory=list)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        number = self.connections = self.connections + 1
        self.open_now += 1
        self.most_open = max(self.most_open, self.open_now)
        try:
            for request in range(1, 1000):
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    (int(line.split(b":")[1]) for line in head.split(b"\r\n")
                     if line.lower().startswith(b"content-length")), 0,
                )  # fmt: skip
                reply = await self.answer(number, request, await reader.readexactly(length))
                if reply is None:
                    break
                writer.write(reply)
                await writer.drain()
                if self.close_after_answer:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            self.closed_by_client.append(number)
        finally:
            self.open_now -= 1
            writer.close()


@asynccontextmanager
async def serving(
    answer: Answer, context: ssl.SSLContext | None = None, *, close_after_answer: bool = False
) -> AsyncIterator[Server]:
    server = Server(answer, close_after_answer)
    listener = await asyncio.start_server(server.handle, "127.0.0.1", 0, ssl=context)
    port = listener.sockets[0].getsockname()[1]
    server.url = f"{'https' if context else 'http'}://127.0.0.1:{port}"
    async with listener:
        yield server


def ok(body: bytes, *extra: bytes) -> bytes:
    head = [b"HTTP/1.1 200 OK", b"Content-Length: %d" % len(body), *extra]
    return b"\r\n".join(head) + b"\r\n\r\n" + body


async def echo(connection: int, request: int, body: bytes) -> bytes:
    return ok(body)


async def test_calls_reuse_one_kept_alive_connection() -> None:
    async with serving(echo) as server, HttptoolsTransport() as http:
        answers = [await http.post(f"{server.url}/v1/x", b"%d" % i, JSON, 5.0) for i in range(5)]
        health = await http.get(f"{server.url}/health", 5.0)
    assert answers == [(200, b"%d" % i) for i in range(5)]
    assert health == (200, b"")
    assert server.connections == 1


async def test_a_chunked_answer_is_read_whole() -> None:
    async def chunked(connection: int, request: int, body: bytes) -> bytes:
        head = b"HTTP/1.1 201 Created\r\nTransfer-Encoding: chunked\r\n\r\n"
        return head + b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"

    async with serving(chunked) as server, HttptoolsTransport() as http:
        assert await http.post(server.url, b"{}", JSON, 5.0) == (201, b"abcde")
        assert await http.post(server.url, b"{}", JSON, 5.0) == (201, b"abcde")
    assert server.connections == 1


async def test_an_answer_without_a_length_ends_when_its_connection_closes() -> None:
    async def until_close(connection: int, request: int, body: bytes) -> bytes:
        return b"HTTP/1.0 200 OK\r\n\r\nall of it"

    async with (
        serving(until_close, close_after_answer=True) as server,
        HttptoolsTransport() as http,
    ):
        for _ in range(2):
            assert await http.post(server.url, b"{}", JSON, 5.0) == (200, b"all of it")
    assert server.connections == 2


async def test_an_answer_that_closes_its_connection_is_read_and_the_connection_not_reused() -> None:
    async def closing(connection: int, request: int, body: bytes) -> bytes:
        return ok(b"bye", b"Connection: close")

    async with serving(closing) as server, HttptoolsTransport() as http:
        for _ in range(3):
            assert await http.post(server.url, b"{}", JSON, 5.0) == (200, b"bye")
    assert server.connections == 3


async def test_a_kept_connection_the_server_dropped_is_retried_on_a_new_one() -> None:
    """The server answers once per connection and drops the next request unanswered, as a
    server closing an idle connection just as a call reuses it would."""

    async def once(connection: int, request: int, body: bytes) -> bytes | None:
        return ok(b"%d" % connection) if request == 1 else None

    async with serving(once) as server, HttptoolsTransport() as http:
        first = await http.post(server.url, b"{}", JSON, 5.0)
        second = await http.post(server.url, b"{}", JSON, 5.0)
    assert (first, second) == ((200, b"1"), (200, b"2"))


async def test_a_new_connection_that_closes_unanswered_is_a_transport_error() -> None:
    async def never(connection: int, request: int, body: bytes) -> None:
        return None

    async with serving(never) as server, HttptoolsTransport() as http:
        with pytest.raises(TransportError, match="the connection broke"):
            await http.post(server.url, b"{}", JSON, 5.0)
    assert server.connections == 1  # a call on a new connection is not retried


async def test_an_answer_that_is_not_http_is_a_transport_error() -> None:
    async def garbage(connection: int, request: int, body: bytes) -> bytes:
        return b"SSH-2.0-OpenSSH_9.6\r\n\r\n"

    async with serving(garbage) as server, HttptoolsTransport() as http:
        with pytest.raises(TransportError, match="not HTTP"):
            await http.post(server.url, b"{}", JSON, 5.0)
        with pytest.raises(TransportError, match="not HTTP"):  # on a new connection
            await http.post(server.url, b"{}", JSON, 5.0)
    assert server.connections == 2


async def test_a_cancelled_call_closes_its_connection_and_the_next_call_gets_its_own() -> None:
    """The cancelled call's answer may still arrive: no later call may read it."""

    async def slow_first(connection: int, request: int, body: bytes) -> bytes:
        if connection == 1:
            await anyio.sleep(0.5)
        return ok(b"%d" % connection)

    async with serving(slow_first) as server, HttptoolsTransport() as http:
        with anyio.move_on_after(0.1):
            await http.post(server.url, b"{}", JSON, 5.0)
        assert await http.post(server.url, b"{}", JSON, 5.0) == (200, b"2")
        await anyio.sleep(0.6)
    assert server.closed_by_client == [1]


async def test_connections_idle_for_longer_than_keep_alive_are_not_reused() -> None:
    async with serving(echo) as server, HttptoolsTransport(keep_alive_s=0.05) as http:
        await http.post(server.url, b"{}", JSON, 5.0)
        await anyio.sleep(0.1)
        await http.post(server.url, b"{}", JSON, 5.0)
        await http.post(server.url, b"{}", JSON, 5.0)
    assert server.connections == 2


async def test_max_connections_bounds_the_sockets_and_callers_wait_for_one() -> None:
    async def slow(connection: int, request: int, body: bytes) -> bytes:
        await anyio.sleep(0.05)
        return ok(body)

    answers: list[tuple[int, bytes]] = []
    async with serving(slow) as server, HttptoolsTransport(max_connections=2) as http:

        async def call(number: int) -> None:
            answers.append(await http.post(server.url, b"%d" % number, JSON, 5.0))

        async with anyio.create_task_group() as group:
            for number in range(8):
                group.start_soon(call, number)
    assert sorted(answers) == sorted((200, b"%d" % n) for n in range(8))
    assert server.most_open == 2


async def test_a_caller_waiting_for_a_connection_times_out_and_leaves_the_pool_working() -> None:
    async def slow(connection: int, request: int, body: bytes) -> bytes:
        await anyio.sleep(0.3)
        return ok(body)

    async with serving(slow) as server, HttptoolsTransport(max_connections=1) as http:
        async with anyio.create_task_group() as group:
            group.start_soon(http.post, server.url, b"first", JSON, 5.0)
            await anyio.sleep(0.05)
            with pytest.raises(TransportTimeout, match=r"no answer within 0\.1 s"):
                await http.post(server.url, b"waits", JSON, 0.1)
        assert await http.post(server.url, b"after", JSON, 5.0) == (200, b"after")
    assert server.connections == 1


async def test_a_full_pool_closes_an_idle_connection_to_another_server() -> None:
    async with (
        serving(echo) as first,
        serving(echo) as second,
        HttptoolsTransport(max_connections=1) as http,
    ):
        await http.post(first.url, b"a", JSON, 5.0)
        assert await http.post(second.url, b"b", JSON, 5.0) == (200, b"b")
        assert await http.post(first.url, b"c", JSON, 5.0) == (200, b"c")
    assert (first.connections, second.connections) == (2, 1)


@pytest.fixture
def certificate(tmp_path: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1, and its key."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-keyout", key, "-out", cert, "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


async def test_https_servers_are_verified_by_the_given_context(
    certificate: tuple[Path, Path],
) -> None:
    cert, key = certificate
    served = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    served.load_cert_chain(cert, key)
    trusted = ssl.create_default_context(cafile=str(cert))
    async with serving(echo, served) as server:
        async with HttptoolsTransport(ssl=trusted) as http:
            assert await http.post(f"{server.url}/v1/x", b"tls", JSON, 5.0) == (200, b"tls")
        async with HttptoolsTransport() as http:  # the system's CAs do not know it
            with pytest.raises(TransportError, match="CERTIFICATE_VERIFY_FAILED"):
                await http.post(server.url, b"tls", JSON, 5.0)
