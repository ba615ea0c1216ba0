"""The engine's threads for blocking tools: bounded, and a hung tool's thread keeps its
place until it really returns (anyio gives a thread's token back as soon as its caller
abandons it, so a pool of hung tools would otherwise grow without bound)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from functools import partial
from typing import TypeVar

import anyio

T = TypeVar("T")

_log = logging.getLogger(__name__)


class _Slot:
    """One blocking tool call's place among the tool threads. The caller and its thread
    each say when they are done with it, under a lock, so exactly one of them gives the
    place back: the caller if the thread returned first, else the thread when it returns."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._returned = False
        self._abandoned = False

    def thread_returned(self) -> bool:
        """In the thread: whether the caller has given up on it (the thread releases)."""
        with self._lock:
            self._returned = True
            return self._abandoned

    def caller_left(self) -> bool:
        """In the caller: whether the thread has returned (the caller releases)."""
        with self._lock:
            self._abandoned = not self._returned
            return self._returned


class ToolThreads:
    """The engine's threads for blocking tools: at most ``bound`` run at once, those of
    abandoned (timed-out or cancelled) calls included until they really return.

    A call waits for a place before its timeout starts (waiting is not the tool's time).
    When every place is held by a hung tool, new calls wait; the first time abandoned
    threads pass half of ``bound`` a warning is logged.
    """

    def __init__(self, bound: int) -> None:
        self.bound = bound
        self._places = anyio.CapacityLimiter(bound)  # held by a _Slot until its thread returns
        # anyio gives a thread's token back as soon as its caller abandons it; the places
        # above bound the threads, so this one (as large) never makes a call wait.
        self._threads = anyio.CapacityLimiter(bound)
        self.abandoned = 0  # threads whose caller gave up, still running
        self._warned = False

    @property
    def busy(self) -> int:
        """Threads running a tool, abandoned ones included."""
        return int(self._places.borrowed_tokens)

    @property
    def waiting(self) -> int:
        """Calls waiting for a thread."""
        return self._places.statistics().tasks_waiting

    async def run(
        self, func: Callable[[], T], timeout_s: float, *, on_place: Callable[[], None] | None = None
    ) -> T:
        """``func()`` in a thread, within ``timeout_s`` once it has one (``TimeoutError``
        past it); ``on_place()`` is called then (the tool's time starts). A thread that
        outlives its call keeps its place until it returns."""
        slot = _Slot()
        await self._places.acquire_on_behalf_of(slot)
        if on_place is not None:
            on_place()
        try:
            with anyio.fail_after(timeout_s):
                return await anyio.to_thread.run_sync(
                    partial(self._in_thread, func, slot),
                    abandon_on_cancel=True,
                    limiter=self._threads,
                )
        finally:
            if slot.caller_left():
                self._places.release_on_behalf_of(slot)
            else:
                self._abandon()

    def _in_thread(self, func: Callable[[], T], slot: _Slot) -> T:
        try:
            return func()
        finally:
            if slot.thread_returned():
                self._back_from_abandoned(slot)

    def _back_from_abandoned(self, slot: _Slot) -> None:
        """In an abandoned thread that returned: give its place back on the event loop
        (this thread waits for the loop to run it, a moment: the tool is done)."""
        try:
            anyio.from_thread.run_sync(self._release_abandoned, slot)
        except Exception:  # the event loop is gone: so is everyone who counted the place
            _log.debug("an abandoned tool thread returned after its event loop ended")

    def _release_abandoned(self, slot: _Slot) -> None:
        self.abandoned -= 1
        self._places.release_on_behalf_of(slot)

    def _abandon(self) -> None:
        self.abandoned += 1
        if not self._warned and self.abandoned > self.bound / 2:
            self._warned = True
            _log.warning(
                "%d of %d tool threads are held by tools that timed out and still run; "
                "blocking tool calls wait once all are (raise engine.tool_threads, or fix "
                "the tool)",
                self.abandoned,
                self.bound,
            )
