"""The events log: what a subscription saw, one JSON line each, read back typed; a line
cut by a crash is skipped."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from libra.events import (
    BucketMoved,
    EventBus,
    FleetSampled,
    InstanceSample,
    StepEnded,
    read_events,
    write_log,
)

pytestmark = pytest.mark.anyio


async def test_the_log_reads_back_what_was_published(tmp_path: Path) -> None:
    bus = EventBus()
    path = tmp_path / "events.jsonl"
    events = [
        BucketMoved(t=1.0, id="t1", source="short", target="long", tool="run", status="failure"),
        FleetSampled(t=2.0, instances=[InstanceSample("a", "short", "active", 3, 1, kv_usage=0.5)]),
        StepEnded(t=3.0, line={"step": 0, "reward_mean": 0.5}),
    ]
    subscription = bus.subscribe()
    async with anyio.create_task_group() as group:
        group.start_soon(write_log, subscription, path)
        for event in events:
            bus.publish(event)
        await anyio.sleep(0.01)
        subscription.close()
    with path.open("ab") as out:
        out.write(b'{"kind":"step","t":4.0,"li')  # a crash mid-line
    assert list(read_events(path)) == events
