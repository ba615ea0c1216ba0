"""Wake-ups the live fleet hands out: a :class:`Latch` set once (an instance drained) and
a :class:`Pulse` that fires again and again (an instance became usable). Both make their
anyio event on the first wait, as a router is often built before any event loop runs."""

from __future__ import annotations

import anyio


class Latch:
    """Set once, awaited by anyone; the anyio event is made on the first wait (a router
    is often built before any event loop runs)."""

    def __init__(self) -> None:
        self._set = False
        self._event: anyio.Event | None = None

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        self._set = True
        if self._event is not None:
            self._event.set()

    async def wait(self) -> None:
        if self._set:
            return
        if self._event is None:
            self._event = anyio.Event()
        await self._event.wait()


class Pulse:
    """Wakes everyone waiting when it fires; later waiters wait for the next firing."""

    def __init__(self) -> None:
        self._event: anyio.Event | None = None

    def fire(self) -> None:
        if self._event is not None:
            self._event.set()
            self._event = None

    async def wait(self) -> None:
        if self._event is None:
            self._event = anyio.Event()
        await self._event.wait()
