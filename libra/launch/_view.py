"""A run's event stream put to use: the fleet sampled onto the bus, the events log
written beside the run's records, and the live view (``libra view``) served, with its
URL printed for the user."""

from __future__ import annotations

import json
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio

from libra.events import (
    CheckpointWritten,
    EvalEnded,
    EventBus,
    FleetSampled,
    InstanceSample,
    StepEnded,
    write_log,
)
from libra.sched import Router
from libra.train import StepRecord
from libra.view import History, serve_view, view_key

FLEET_INTERVAL_S = 1.0


@dataclass(frozen=True)
class ViewOptions:
    """``--view [PORT]``, ``--view-host``, ``--view-key``: where the view listens (port
    0: any free one) and the key it asks for off loopback (``allows``: other keys it
    takes, the gateway's admin keys)."""

    port: int = 0
    host: str = "127.0.0.1"
    key: str | None = None
    allows: Callable[[str], bool] | None = None


def fleet_sample(bus: EventBus, router: Router) -> FleetSampled:
    instances = [
        InstanceSample(
            name,
            instance.bucket,
            "down" if instance.marked_down else instance.state,
            instance.in_flight,
            instance.endpoint.weight_version,
            instance.waiting_gauge,
            instance.kv_usage_gauge,
        )
        for name, instance in router.by_name.items()
    ]
    return FleetSampled(t=bus.t(), instances=instances)


async def publish_fleet(
    bus: EventBus, router: Router, interval_s: float = FLEET_INTERVAL_S
) -> None:
    """The fleet onto the bus every ``interval_s`` while it changes (an idle gateway's
    log does not grow by a line a second), until cancelled."""
    last: list[InstanceSample] | None = None
    try:
        while True:
            sample = fleet_sample(bus, router)
            if sample.instances != last:
                bus.publish(sample)
                last = sample.instances
            await anyio.sleep(interval_s)
    finally:  # how the fleet was left: a finished run's view shows nothing in flight
        sample = fleet_sample(bus, router)
        if sample.instances != last:
            bus.publish(sample)


@asynccontextmanager
async def run_events(
    bus: EventBus,
    *,
    log: Path | None = None,
    view: ViewOptions | None = None,
    find_record: Callable[[str], bytes | None] | None = None,
) -> AsyncIterator[None]:
    """While the block runs: ``bus``'s events appended to ``log``, and with ``view`` the
    live view served (it finds an ended trajectory's record with ``find_record``)."""
    async with AsyncExitStack() as stack:
        group = await stack.enter_async_context(anyio.create_task_group())
        subscriptions = []
        if log is not None:
            subscriptions.append(bus.subscribe())
            group.start_soon(write_log, subscriptions[-1], log)
        if view is not None:
            history = History(live=True, find_record=find_record)
            subscriptions.append(bus.subscribe())
            group.start_soon(history.follow, subscriptions[-1])
            key = view.key if view.allows is not None else view_key(view.host, view.key)
            url = await stack.enter_async_context(
                serve_view(history, view.host, view.port, key, view.allows)
            )
            also = " (or ?key=<an admin key>)" if view.allows is not None else ""
            print(f"libra view: {url}{also}", file=sys.stderr, flush=True)
        try:
            yield
        finally:
            for subscription in subscriptions:  # what they hold is written, then they end
                subscription.close()


class PublishedRun:
    """The training loop's lines onto the bus (a :class:`~libra.train.RunObserver`):
    each step's, with the allocation loop's decision in it, and each evaluation's."""

    def __init__(self, bus: EventBus) -> None:
        self.bus = bus

    async def step(self, record: StepRecord) -> None:
        self.bus.publish(StepEnded(t=self.bus.t(), line=json.loads(record.to_json())))

    async def evaluation(self, line: dict[str, Any]) -> None:
        self.bus.publish(EvalEnded(t=self.bus.t(), line=line))

    async def checkpoint(self, steps_done: int, path: Path) -> None:
        self.bus.publish(CheckpointWritten(t=self.bus.t(), steps_done=steps_done, path=str(path)))


def last_t(log: Path) -> float:
    """Where a resumed run's events go on from: the last ``t`` its log holds (0: none)."""
    if not log.is_file() or log.stat().st_size == 0:
        return 0.0
    with log.open("rb") as lines:
        lines.seek(max(0, log.stat().st_size - 65536))
        for line in reversed(lines.read().splitlines()):
            try:
                return float(json.loads(line)["t"])
            except (ValueError, KeyError, TypeError):
                continue
    return 0.0
