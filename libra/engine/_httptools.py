""":class:`HttptoolsTransport`: the engine's HTTP/1.1 client, kept-alive connections read
by httptools.

The engine's whole use of HTTP is one JSON POST (or a small GET) and the answer's status
and bytes, over and over, to a few servers. aiohttp does that, and much else per
request: a request and a response object, a URL object, header multidicts, a timer
context, a payload writer. Against the zero-latency emulated server on these machines
it spent 190-300 µs of CPU a call, this transport about 80 (``libra bench engine``
prints both side by side). What is left is what a call needs: write the request's bytes
to a kept-alive socket (an asyncio protocol), feed the answer to httptools' parser (the
llhttp parser uvicorn reads requests with), and wait on one future, with one timer.

- **Connections** are kept per origin (scheme, host, port) and reused last-in first-out,
  so a steady load keeps a small hot set. ``max_connections`` bounds the sockets to all
  servers together: a call beyond it waits for one to come free (an idle one to another
  server is closed to make room).
- **A connection the server closed while idle** is dropped from the pool when the close
  arrives. One that closes as a call reuses it, before any byte of an answer came back,
  is retried once on a new connection: the server dropped an idle connection, it did not
  read the request. Connections idle for longer than ``keep_alive_s`` (below uvicorn's,
  and so vLLM's, 5 s) are not reused.
- **A call that ends without its answer** (its timeout, a cancellation, a broken
  connection) aborts its connection: an answer may still be on its way, and the next
  call must not read it. For a vLLM server the abort is also what cancels the request.
"""

from __future__ import annotations

import asyncio
import collections
import ssl as ssl_module
import time
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import cast

import httptools

from libra.engine._http import BaseTransport, TransportError, TransportTimeout

_Origin = tuple[str, str, int]  # scheme, host, port
_DELIMITING = (b"content-length", b"transfer-encoding")
_Answer = tuple[int, bytes]


@dataclass(frozen=True, slots=True)
class _Target:
    """What a URL gives a request: where it connects, and its request line's parts."""

    origin: _Origin
    path: bytes  # with the query
    host: bytes  # the Host header

    @classmethod
    def of(cls, url: str) -> _Target:
        split = urllib.parse.urlsplit(url)
        if split.scheme not in ("http", "https") or not split.hostname:
            raise TransportError(f"not an http(s) URL: {url!r}")
        port = split.port or (443 if split.scheme == "https" else 80)
        path = (split.path or "/") + (f"?{split.query}" if split.query else "")
        host = split.netloc.rpartition("@")[2]  # (no user:password@ in a Host header)
        return cls((split.scheme, split.hostname, port), path.encode(), host.encode())


class _Connection(asyncio.Protocol):
    """One kept-alive socket: one call at a time writes a request and waits for its
    answer, which httptools' callbacks assemble."""

    def __init__(self, origin: _Origin) -> None:
        self.origin = origin
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self.reused = False  # it answered a call before this one
        self.received = False  # a byte of the current call's answer came
        self.counted = True  # in the pool's count of open sockets
        self.on_lost: Callable[[_Connection], None] | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._answer: asyncio.Future[_Answer] | None = None
        self._body: list[bytes] = []
        # An answer with neither a length nor chunks ends when its connection closes.
        self._until_close = False
        self._delimited = False

    # ----------------------------------------------------------- the call's side

    def send(self, request: bytes, answer: asyncio.Future[_Answer]) -> None:
        assert self.transport is not None
        self.received = self._until_close = False
        self._answer = answer
        self.transport.write(request)

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    # ----------------------------------------------------------- asyncio's side

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # (uvloop's transports are asyncio.Transports in all but their class)
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.received = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(TransportError(f"the server's answer is not HTTP: {exc}"))
            self.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._until_close and exc is None:
            self.on_message_complete()
        reason = f"{type(exc).__name__}: {exc}" if exc is not None else "closed by the server"
        self._fail(TransportError(f"the connection broke ({reason})"))
        if self.on_lost is not None:
            self.on_lost(self)

    def _fail(self, error: TransportError) -> None:
        answer, self._answer = self._answer, None
        if answer is not None and not answer.done():
            answer.set_exception(error)

    # ----------------------------------------------------------- httptools' callbacks

    def on_headers_complete(self) -> None:
        # httptools cannot be told of the close that ends such an answer: note it here.
        self._until_close = not self._delimited and self._parser.get_status_code() >= 200

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() in _DELIMITING:
            self._delimited = True

    def on_message_begin(self) -> None:
        self._delimited = False

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        self._until_close = False
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        self._body = []
        answer, self._answer = self._answer, None
        if not self._parser.should_keep_alive():
            self.abort()  # (after the answer: nothing else will come)
        if answer is not None and not answer.done():
            answer.set_result((self._parser.get_status_code(), body))


class HttptoolsTransport(BaseTransport):
    """See the module. ``ssl`` verifies https servers (default: the system's CAs)."""

    def __init__(
        self,
        max_connections: int = 1024,
        *,
        keep_alive_s: float = 4.0,
        ssl: ssl_module.SSLContext | None = None,
    ) -> None:
        self.max_connections = max_connections
        self.keep_alive_s = keep_alive_s
        self._ssl = ssl
        self._idle: dict[_Origin, list[_Connection]] = {}
        self._open = 0  # sockets, idle or in use, and connects under way
        self._waiting: collections.deque[asyncio.Future[None]] = collections.deque()
        self._targets: dict[str, _Target] = {}
        self._closing = False

    async def _request(
        self,
        method: str,
        url: str,
        body: bytes | None,
        headers: Mapping[str, str],
        timeout_s: float,
    ) -> _Answer:
        target = self._target(url)
        request = _request_bytes(method, target, body, headers)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        for retry in (True, False):  # retried only when a reused connection was stale
            connection = await self._connection(target.origin, deadline, timeout_s)
            try:
                return await self._exchange(loop, connection, request, deadline, timeout_s)
            except TransportTimeout:
                raise
            except TransportError:
                if not (retry and connection.reused and not connection.received):
                    raise
        raise AssertionError("unreachable")

    async def _exchange(
        self,
        loop: asyncio.AbstractEventLoop,
        connection: _Connection,
        request: bytes,
        deadline: float,
        timeout_s: float,
    ) -> _Answer:
        answer: asyncio.Future[_Answer] = loop.create_future()
        timer = loop.call_at(deadline, _expire, answer, timeout_s)
        connection.send(request, answer)
        try:
            result = await answer
        except BaseException:  # its answer may still come: no later call may read it
            self._discard(connection)
            raise
        finally:
            timer.cancel()
        self._release(connection)
        return result

    # ------------------------------------------------------------------ the pool

    async def _connection(self, origin: _Origin, deadline: float, timeout_s: float) -> _Connection:
        """An idle connection to ``origin``, else a new one once there is room for it."""
        while (connection := self._take_idle(origin)) is None:
            if self._open < self.max_connections:
                self._open += 1
                try:
                    return await self._connect(origin, deadline, timeout_s)
                except BaseException:
                    self._open -= 1
                    self._wake_one()
                    raise
            if not self._close_an_idle_one():  # (to another origin: this one has none)
                await self._wait_for_room(deadline, timeout_s)
        return connection

    def _take_idle(self, origin: _Origin) -> _Connection | None:
        idle = self._idle.get(origin)
        now = time.monotonic()
        while idle:
            connection = idle.pop()
            if not connection.closed and now - connection.idle_since < self.keep_alive_s:
                return connection
            self._discard(connection)
        return None

    async def _connect(self, origin: _Origin, deadline: float, timeout_s: float) -> _Connection:
        scheme, host, port = origin
        context = None
        if scheme == "https":
            context = self._ssl or ssl_module.create_default_context()
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout_at(deadline):
                _, connection = await loop.create_connection(
                    lambda: _Connection(origin),
                    host,
                    port,
                    ssl=context,
                    server_hostname=host if context is not None else None,
                )
        except TimeoutError as exc:
            raise TransportTimeout.after(timeout_s) from exc
        except OSError as exc:
            raise TransportError(f"cannot connect to {host}:{port}: {exc}") from exc
        connection.on_lost = self._lost
        return connection

    def _release(self, connection: _Connection) -> None:
        """A call's connection, its answer read: back to the pool while it stays open."""
        if connection.closed or self._closing:
            self._discard(connection)
            return
        connection.reused = True
        connection.idle_since = time.monotonic()
        self._idle.setdefault(connection.origin, []).append(connection)
        self._wake_one()

    def _lost(self, connection: _Connection) -> None:
        """The socket closed (by the server, or by :meth:`_discard`)."""
        idle = self._idle.get(connection.origin)
        if idle is not None and connection in idle:
            idle.remove(connection)
        self._discard(connection)

    def _discard(self, connection: _Connection) -> None:
        """Close ``connection`` and make its room in the count (once)."""
        connection.abort()
        if connection.counted:
            connection.counted = False
            self._open -= 1
            self._wake_one()

    def _close_an_idle_one(self) -> bool:
        for idle in self._idle.values():
            if idle:
                self._discard(idle.pop(0))  # the least recently used
                return True
        return False

    async def _wait_for_room(self, deadline: float, timeout_s: float) -> None:
        # A caller that gives up leaves its future in the queue, cancelled, and
        # _wake_one skips it: removing it would cost a scan of the queue.
        room = asyncio.get_running_loop().create_future()
        self._waiting.append(room)
        try:
            async with asyncio.timeout_at(deadline):
                await room
        except TimeoutError as exc:
            raise TransportTimeout.after(timeout_s) from exc
        except BaseException:
            if room.done() and not room.cancelled():  # woken, then cancelled: pass it on
                self._wake_one()
            raise

    def _wake_one(self) -> None:
        while self._waiting:
            room = self._waiting.popleft()
            if not room.done():
                room.set_result(None)
                return

    def _target(self, url: str) -> _Target:
        target = self._targets.get(url)
        if target is None:
            if len(self._targets) >= 256:
                self._targets.clear()
            target = self._targets[url] = _Target.of(url)
        return target

    async def aclose(self) -> None:
        self._closing = True
        idle = [connection for connections in self._idle.values() for connection in connections]
        self._idle.clear()
        for connection in idle:
            self._discard(connection)


def _request_bytes(
    method: str, target: _Target, body: bytes | None, headers: Mapping[str, str]
) -> bytes:
    lines = [method.encode(), b" ", target.path, b" HTTP/1.1\r\nHost: ", target.host, b"\r\n"]
    for name, value in headers.items():
        lines.append(f"{name}: {value}\r\n".encode("latin-1"))
    if body is not None:
        lines.append(b"Content-Length: %d\r\n\r\n" % len(body))
        lines.append(body)
    else:
        lines.append(b"\r\n")
    return b"".join(lines)


def _expire(answer: asyncio.Future[_Answer], timeout_s: float) -> None:
    if not answer.done():
        answer.set_exception(TransportTimeout.after(timeout_s))
