"""uvicorn's HTTP protocol for ``libra serve``: each answer written to its socket once
instead of twice, and the app told of a client's disconnect without a task waiting.

**One write.** uvicorn writes a response's status line and headers when the app sends
``http.response.start`` and its body when the app sends ``http.response.body``: two
socket writes, and on loopback two deliveries, each waking the client. ``libra serve``
sends both messages back to back, and sampled with py-spy under ``libra bench serve``
the two writes were about a sixth of the gateway's CPU. Here every write the protocol
makes within one turn of the event loop goes out as one, at the end of the turn
(``call_soon``): the bytes and their order are unchanged; a close, an abort or an
end-of-file flushes what is held first, and what is held when the connection has gone
is dropped, as a write to a closed socket would be.

**Disconnects.** Each request's scope carries the ``libra.disconnect`` extension
(``libra/_asgi.py``): the callback the app puts there is called when the connection is
lost before the response is complete, so the gateway cancels a generation without a
task per request waiting on ``receive()`` for the news.
"""

from __future__ import annotations

import asyncio
from typing import Any, cast

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from libra._asgi import DISCONNECT_EXTENSION


class ServeHttpToolsProtocol(HttpToolsProtocol):
    """``HttpToolsProtocol`` over a :class:`CoalescingTransport`, offering each request
    the ``libra.disconnect`` extension (see the module)."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # (uvloop's transports are asyncio.Transports in all but their class)
        super().connection_made(CoalescingTransport(cast(asyncio.Transport, transport)))

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.scope["extensions"] = {DISCONNECT_EXTENSION: {}}

    def connection_lost(self, exc: Exception | None) -> None:
        cycle = self.cycle
        super().connection_lost(exc)
        if cycle is not None and cycle.disconnected:  # (its response was not complete)
            extension = cycle.scope["extensions"][DISCONNECT_EXTENSION]
            extension["disconnected"] = True
            callback = extension.get("callback")
            if callable(callback):
                callback()


class CoalescingTransport(asyncio.Transport):
    """``transport``, its writes within one loop turn joined into one (see the module)."""

    def __init__(self, transport: asyncio.Transport) -> None:
        super().__init__()
        self._transport = transport
        self._held: list[bytes] = []
        # (asyncio.get_running_loop() makes a system call, getpid, each time)
        self._loop = asyncio.get_running_loop()

    def write(self, data: bytes | bytearray | memoryview[Any]) -> None:
        if not self._held:
            self._loop.call_soon(self.flush)
        self._held.append(bytes(data))

    def writelines(self, list_of_data: Any) -> None:
        for data in list_of_data:
            self.write(data)

    def flush(self) -> None:
        """Write what is held, in one write (nothing once the connection is closing)."""
        if not self._held:
            return
        held, self._held = self._held, []
        if not self._transport.is_closing():
            self._transport.write(held[0] if len(held) == 1 else b"".join(held))

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def abort(self) -> None:
        self._held = []
        self._transport.abort()

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def can_write_eof(self) -> bool:
        return self._transport.can_write_eof()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._transport.get_extra_info(name, default)

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._transport.set_protocol(protocol)

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._transport.get_protocol()

    def is_reading(self) -> bool:
        return self._transport.is_reading()

    def pause_reading(self) -> None:
        self._transport.pause_reading()

    def resume_reading(self) -> None:
        self._transport.resume_reading()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._transport.set_write_buffer_limits(high, low)

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + sum(map(len, self._held))

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._transport.get_write_buffer_limits()
