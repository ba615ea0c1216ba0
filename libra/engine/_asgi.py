"""A lean in-process HTTP transport: the engine's requests straight into an ASGI app.

``http_transport(httpx.ASGITransport(app))`` works too, but httpx builds and parses
full request and response models (URLs, cookies, headers) around every call, about a
fifth of a scheduling benchmark's run time. This transport implements the engine's
two-method :class:`~libra.engine.HTTPTransport` protocol by handing the body to the
app as one ASGI ``http.request`` message and collecting the answer; the app, the
engine's client and everything above it are unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any

import anyio

from libra.engine._http import BaseTransport, TransportError, TransportTimeout

ASGIApp = Any  # an ASGI 3 callable (scope, receive, send)
Message = MutableMapping[str, Any]


class ASGITransport(BaseTransport):
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def _request(
        self,
        method: str,
        url: str,
        body: bytes | None,
        headers: Mapping[str, str],
        timeout_s: float,
    ) -> tuple[int, bytes]:
        scheme, _, rest = url.partition("://")
        host, slash, path = rest.partition("/")
        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": method,
            "scheme": scheme,
            "path": slash + path,
            "raw_path": (slash + path).encode(),
            "query_string": b"",
            "root_path": "",
            "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
            "server": (host, 80),
            "client": ("127.0.0.1", 1),
        }
        exchange = _Exchange(body or b"")
        try:
            with anyio.fail_after(timeout_s):
                await self.app(scope, exchange.receive, exchange.send)
        except TimeoutError as exc:
            raise TransportTimeout(f"{url}: no answer within {timeout_s:g} s") from exc
        except OSError as exc:  # what a fleet app raises for a server that is not there
            raise TransportError(f"{url}: {exc}") from exc
        finally:
            exchange.done.set()
        if exchange.status is None:
            raise TransportError(f"{url}: the app sent no response")
        return exchange.status, b"".join(exchange.chunks)

    async def aclose(self) -> None:
        pass  # nothing held: the app is the caller's


class _Exchange:
    """One request's ASGI channel: the body once, then a disconnect only when done."""

    def __init__(self, body: bytes) -> None:
        self.body: bytes | None = body
        self.done = anyio.Event()
        self.status: int | None = None
        self.chunks: list[bytes] = []

    async def receive(self) -> Message:
        if self.body is not None:
            body, self.body = self.body, None
            return {"type": "http.request", "body": body, "more_body": False}
        await self.done.wait()  # the client stays connected until the answer is complete
        return {"type": "http.disconnect"}

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
        elif message["type"] == "http.response.body":
            self.chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                self.done.set()
