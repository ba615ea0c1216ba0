"""Small helpers shared by Libra's raw ASGI apps (the emulated server and the gateway).

Both serve HTTP without a web framework, so that a request costs little more than
decoding and encoding its JSON; these are the few pieces of the ASGI protocol they share.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import anyio

ASGIMessage = MutableMapping[str, Any]
Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[ASGIMessage]]
Send = Callable[[ASGIMessage], Awaitable[None]]


class ClientDisconnected(Exception):
    """The client went away before its answer was ready; nobody to answer."""


class BodyTooLarge(Exception):
    """The request's body is over the app's limit."""


DISCONNECT_EXTENSION = "libra.disconnect"
"""A scope extension: the server calls the ``"callback"`` the app puts in it when the
client goes away before the response is complete (and notes ``"disconnected"`` there,
for a callback put in later).

ASGI tells an app of a disconnect only through ``receive()``, so an app that must notice
one while it works keeps a task waiting there, a task a request. ``libra serve``'s
uvicorn protocol (``libra/gateway/_http_protocol.py``) offers this hook instead; other servers
do not, and the app falls back to the waiting task."""


def on_disconnect(scope: Scope, callback: Callable[[], object]) -> bool:
    """Have the server call ``callback`` if the client goes away before the response is
    complete (at once if it has gone); False when the server offers no such hook."""
    extension = scope.get("extensions", {}).get(DISCONNECT_EXTENSION)
    if extension is None:
        return False
    extension["callback"] = callback
    if extension.get("disconnected"):  # already gone (after its body came)
        callback()
    return True


async def read_body(receive: Receive, limit: int | None = None) -> bytes:
    """The request's whole body; :class:`BodyTooLarge` as soon as it passes ``limit``."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnected
        chunk = message.get("body", b"")
        size += len(chunk)
        if limit is not None and size > limit:
            raise BodyTooLarge
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def cancel_on_disconnect(receive: Receive, scope: anyio.CancelScope) -> None:
    """Cancel ``scope`` when the client disconnects (ASGI servers say so via receive)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            scope.cancel()
            return


async def serve_lifespan(receive: Receive, send: Send) -> None:
    """Acknowledge startup and shutdown; for apps that hold no resources needing them."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


def header(scope: Scope, name: bytes) -> bytes | None:
    """The value of the request header ``name`` (lower case), or None."""
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value)
    return None
