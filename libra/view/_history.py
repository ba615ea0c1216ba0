"""What the view has seen of a run: its events as encoded batches (each a JSON array,
encoded once for every page that reads it), live from a bus or read from a run's events
log, and where the records of ended trajectories are found (their conversations)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from itertools import islice
from pathlib import Path

import anyio

from libra.events import Event, Subscription, encode, read_events

_BATCH_S = 0.25  # how often a live page gets what happened since
_REPLAY_BATCH = 5000  # events per batch when a log is replayed


class History:
    """Every event of the run so far, in batches; :meth:`changed` wakes the pages."""

    def __init__(
        self, *, live: bool, find_record: Callable[[str], bytes | None] | None = None
    ) -> None:
        self.batches: list[bytes] = []
        self.live = live  # events still come (until :meth:`follow` ends)
        self._changed = anyio.Event()
        self._find_record = find_record

    def add(self, events: Iterable[Event]) -> None:
        body = b",".join(encode(event) for event in events)
        if body:
            self.batches.append(b"[" + body + b"]")
            self._changed.set()
            self._changed = anyio.Event()

    async def changed(self) -> None:
        await self._changed.wait()

    async def follow(self, subscription: Subscription) -> None:
        """Take the bus's events as they come, until the subscription closes."""
        try:
            async for batch in subscription.batches(_BATCH_S):
                self.add(batch)
        finally:
            self.live = False
            self._changed.set()

    def replay(self, log: Path) -> None:
        """A finished run's events, from its log."""
        events = iter(read_events(log))
        while batch := list(islice(events, _REPLAY_BATCH)):
            self.add(batch)

    def record(self, trajectory_id: str) -> bytes | None:
        """An ended trajectory's record (JSON), for its conversation; None if not found
        (yet). It may read files: call it off the event loop."""
        return self._find_record(trajectory_id) if self._find_record is not None else None
