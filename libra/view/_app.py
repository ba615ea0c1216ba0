"""The view's HTTP surface, a raw ASGI app: the page and its files (shipped in the
package: nothing from a CDN), ``/events`` (server-sent events: every batch so far, then
each new one as it comes), ``/record/<id>`` (an ended trajectory's record).

With a key (or ``allows``, a check of the key given: the gateway's admin keys), every
request must carry one (``?key=...``: the page passes its own on to what it loads; or
``Authorization: Bearer ...``), else 401.
"""

from __future__ import annotations

import hmac
import importlib.resources
import urllib.parse
from collections.abc import Callable

import anyio

from libra._asgi import Receive, Scope, Send, cancel_on_disconnect, header
from libra.view._history import History

_TYPES = {".html": b"text/html; charset=utf-8", ".js": b"text/javascript", ".css": b"text/css"}


class ViewApp:
    def __init__(
        self,
        history: History,
        key: str | None = None,
        allows: Callable[[str], bool] | None = None,
    ) -> None:
        self.history = history
        self.key = key
        self.allows = allows
        static = importlib.resources.files("libra.view") / "static"
        self.files = {
            entry.name: entry.read_bytes() for entry in static.iterdir() if entry.is_file()
        }

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        path = scope["path"]
        if not self._allowed(scope):
            await _answer(send, 401, b"text/plain", b"this view needs its key: ?key=...\n")
        elif path in ("/", "/index.html"):
            await self._file(send, "index.html")
        elif path.startswith("/static/"):
            await self._file(send, path.removeprefix("/static/"))
        elif path == "/events":
            await self._events(receive, send)
        elif path.startswith("/record/"):
            # (the path comes percent-decoded; finding a record may read the run's files)
            trajectory_id = path.removeprefix("/record/")
            record = await anyio.to_thread.run_sync(self.history.record, trajectory_id)
            if record is None:
                await _answer(send, 404, b"text/plain", b"no record (yet) of that trajectory\n")
            else:
                await _answer(send, 200, b"application/json", record)
        else:
            await _answer(send, 404, b"text/plain", b"not found\n")

    def _allowed(self, scope: Scope) -> bool:
        if self.key is None and self.allows is None:
            return True
        query = urllib.parse.parse_qs(scope.get("query_string", b"").decode())
        given = query.get("key", [""])[-1]
        bearer = (header(scope, b"authorization") or b"").decode()
        if bearer.startswith("Bearer "):
            given = given or bearer.removeprefix("Bearer ")
        if self.key is not None and hmac.compare_digest(given.encode(), self.key.encode()):
            return True
        return bool(given) and self.allows is not None and self.allows(given)

    async def _file(self, send: Send, name: str) -> None:
        body = self.files.get(name)
        suffix = name[name.rfind(".") :] if "." in name else ""
        if body is None or suffix not in _TYPES:
            await _answer(send, 404, b"text/plain", b"not found\n")
        else:
            await _answer(send, 200, _TYPES[suffix], body)

    async def _events(self, receive: Receive, send: Send) -> None:
        headers = [
            (b"content-type", b"text/event-stream"),
            (b"cache-control", b"no-store"),
        ]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        history = self.history
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as group:
                group.start_soon(cancel_on_disconnect, receive, scope)
                sent = 0
                while True:
                    while sent < len(history.batches):
                        body = b"data: " + history.batches[sent] + b"\n\n"
                        await send({"type": "http.response.body", "body": body, "more_body": True})
                        sent += 1
                    if not history.live:  # the page keeps what it has, and stops asking
                        state = b"event: state\ndata: finished\n\n"
                        await send({"type": "http.response.body", "body": state, "more_body": True})
                        scope.cancel()
                        break
                    await history.changed()
        await send({"type": "http.response.body", "body": b""})


async def _answer(send: Send, status: int, kind: bytes, body: bytes) -> None:
    headers = [(b"content-type", kind), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
