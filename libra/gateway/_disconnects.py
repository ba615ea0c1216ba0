"""A client that leaves: a generating request watched for its client's disconnect, which
cancels the core's call (and with it the upstream request) if it is still running."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import anyio

from libra._asgi import ClientDisconnected, Receive

_T = TypeVar("_T")


class Watch:
    """Watches a generating request for its client's disconnect, which cancels the
    core's call (and with it the upstream request) if it is still running."""

    __slots__ = ("_cancel", "ended")

    def __init__(self) -> None:
        self.ended = False  # the client has gone
        self._cancel: Callable[[], object] | None = None  # cancels the call running

    def client_left(self) -> None:
        self.ended = True
        if self._cancel is not None:
            self._cancel()

    async def run(self, receive: Receive) -> None:
        """Wait on ``receive`` for the disconnect (servers without a disconnect hook)."""
        while (await receive())["type"] != "http.disconnect":
            pass
        self.client_left()

    async def call(self, call: Callable[[], Awaitable[_T]]) -> _T:
        """``call``'s result; :class:`ClientDisconnected` once the client has gone."""
        task = asyncio_task()
        if task is None:  # trio
            with anyio.CancelScope() as scope:
                self._cancel = scope.cancel
                try:
                    return await call()
                finally:
                    self._cancel = None
            raise ClientDisconnected  # the scope was cancelled: the client left
        # On asyncio the request's own task is cancelled: a cancel scope a request
        # cost a twentieth of the gateway's CPU under ``libra bench serve``.
        self._cancel = task.cancel
        try:
            return await call()
        except asyncio.CancelledError:
            if self.ended and task.uncancel() == 0:  # (no one else cancels the task)
                raise ClientDisconnected from None
            raise
        finally:
            self._cancel = None


def asyncio_task() -> asyncio.Task[Any] | None:
    """The asyncio task running, or None on another event loop (trio)."""
    try:
        return asyncio.current_task()
    except RuntimeError:
        return None


def bare_task(watching: Coroutine[Any, Any, None]) -> asyncio.Task[None] | None:
    """On asyncio, ``watching`` as a bare task: an anyio task group and its task cost
    ~0.1 ms a request, a sixth of the gateway's CPU. The watcher needs no cancel scope
    of its own (it only waits on ``receive`` and cancels the watched call), and the
    caller cancels it when the exchange ends. None elsewhere (trio): use a task group."""
    task = asyncio_task()
    if task is None:
        watching.close()
        return None
    return task.get_loop().create_task(watching)
