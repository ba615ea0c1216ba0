"""One process's event bus: publishing is a few appends (the engine publishes from its
hot path), and each subscriber reads what was published since in batches, at its pace.
A subscriber that falls behind by more than its limit loses the oldest events it had
not read, counted in ``dropped``: publishing never waits. A listener instead folds each
event as it is published (a counter such as the gateway's ``/metrics``): nothing queues,
nothing is lost, and it must cost no more than the append it replaces."""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterator, Callable

import anyio

from libra._clock import now
from libra.events._events import Event


class EventBus:
    """``offset``: the ``t`` it starts at (a resumed run goes on from its log's last)."""

    def __init__(self, clock: Callable[[], float] = now, offset: float = 0.0) -> None:
        self._clock = clock
        self.started = clock() - offset
        self._subscriptions: list[Subscription] = []
        self._listeners: list[Callable[[Event], None]] = []

    def t(self) -> float:
        """Seconds since the bus started: an event's ``t``."""
        return self._clock() - self.started

    def publish(self, event: Event) -> None:
        for subscription in self._subscriptions:
            subscription.put(event)
        for listener in self._listeners:
            listener(event)

    def listen(self, listener: Callable[[Event], None]) -> None:
        """Call ``listener`` with each event as it is published, from the publisher."""
        self._listeners.append(listener)

    def subscribe(self, limit: int = 1_000_000) -> Subscription:
        subscription = Subscription(self, limit)
        self._subscriptions.append(subscription)
        return subscription

    def unsubscribe(self, subscription: Subscription) -> None:
        if subscription in self._subscriptions:
            self._subscriptions.remove(subscription)


class Subscription:
    """What one subscriber has not read yet (at most ``limit`` events)."""

    def __init__(self, bus: EventBus, limit: int) -> None:
        self.bus = bus
        self.limit = limit
        self.dropped = 0
        self._events: deque[Event] = deque()
        self._ready: anyio.Event | None = None
        self.closed = False

    def put(self, event: Event) -> None:
        if len(self._events) >= self.limit:
            self._events.popleft()
            self.dropped += 1
        self._events.append(event)
        if self._ready is not None:
            self._ready.set()
            self._ready = None

    def take(self) -> list[Event]:
        """Every event not read yet, oldest first."""
        events = list(self._events)
        self._events.clear()
        return events

    async def batches(self, interval_s: float = 0.0) -> AsyncIterator[list[Event]]:
        """Batches of events as they come (at most one batch per ``interval_s``), until
        :meth:`close`; the last holds what came before it."""
        while True:
            if not self._events and not self.closed:
                self._ready = anyio.Event()
                await self._ready.wait()
            batch = self.take()
            if batch:
                yield batch
            if self.closed:
                return
            if interval_s:
                await anyio.sleep(interval_s)

    def close(self) -> None:
        """No more events: :meth:`batches` ends after what it holds."""
        self.closed = True
        self.bus.unsubscribe(self)
        if self._ready is not None:
            self._ready.set()
            self._ready = None
