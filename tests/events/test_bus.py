"""The event bus: every subscriber gets every event in order, in batches; one that falls
behind loses the oldest, counted, and publishing never waits."""

from __future__ import annotations

import anyio
import anyio.lowlevel
import pytest

from libra.events import CheckpointWritten, EventBus

pytestmark = pytest.mark.anyio


async def test_each_subscriber_reads_every_event_in_order() -> None:
    bus = EventBus()
    first, second = bus.subscribe(), bus.subscribe()
    seen: list[int] = []

    async def read() -> None:
        async for batch in first.batches():
            seen.extend(e.steps_done for e in batch if isinstance(e, CheckpointWritten))

    async with anyio.create_task_group() as group:
        group.start_soon(read)
        for step in range(5):
            bus.publish(CheckpointWritten(t=bus.t(), steps_done=step, path=""))
            await anyio.lowlevel.checkpoint()
        first.close()
    assert seen == [0, 1, 2, 3, 4]
    assert [event.steps_done for event in second.take()] == [0, 1, 2, 3, 4]  # type: ignore[attr-defined]
    assert bus._subscriptions == [second]  # the closed one is gone


async def test_a_subscriber_behind_by_its_limit_loses_the_oldest_counted() -> None:
    bus = EventBus()
    slow = bus.subscribe(limit=3)
    for step in range(5):
        bus.publish(CheckpointWritten(t=0.0, steps_done=step, path=""))
    assert [event.steps_done for event in slow.take()] == [2, 3, 4]  # type: ignore[attr-defined]
    assert slow.dropped == 2
