"""The gateway's Prometheus metrics (``/metrics``) and the figures of its console line.

Counted by the surface as requests go by: requests by route and status, the latency of
whole requests and of the time spent in the core, requests in progress. Folded from the
run's events (``libra.events``) as they are published, as the view and the events log
read them: generation calls upstream and their tokens per bucket and endpoint, and the
moves between buckets (a promotion: to a shorter one). Read from the router when
scraped: calls in flight and queue depth per upstream endpoint.
"""

from __future__ import annotations

import bisect
import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from libra.events import BucketMoved, CallEnded, Event, EventBus
from libra.sched import Router

CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5,
                    10, 30, 60, 120)  # fmt: skip


@dataclass
class Totals:
    """What the console line shows: running totals, read once a second."""

    requests: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    in_progress: int = 0
    started: float = field(default_factory=time.monotonic)


class Count:
    """A counter or gauge kept as a plain number, exported when scraped:
    prometheus-client's own take a lock on every update."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1) -> None:
        self.value += amount

    def dec(self) -> None:
        self.value -= 1


class Latencies:
    """A histogram of seconds over ``_LATENCY_BUCKETS``, exported when scraped."""

    __slots__ = ("counts", "sum")

    def __init__(self) -> None:
        self.counts = [0] * (len(_LATENCY_BUCKETS) + 1)  # the last: above every bound
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(_LATENCY_BUCKETS, seconds)] += 1
        self.sum += seconds

    def buckets(self) -> list[tuple[str, float]]:
        bounds = [*map(floatToGoString, _LATENCY_BUCKETS), "+Inf"]
        return list(zip(bounds, itertools.accumulate(self.counts), strict=True))


@dataclass
class RouteMetrics:
    """One route's metrics."""

    name: str
    in_progress: Count = field(default_factory=Count)
    disconnects: Count = field(default_factory=Count)
    latency: Latencies = field(default_factory=Latencies)
    core_latency: Latencies = field(default_factory=Latencies)
    statuses: dict[int, Count] = field(default_factory=dict)


@dataclass
class BucketMetrics:
    """Generation calls to one endpoint in one bucket, by outcome, and their tokens."""

    calls: dict[str, Count] = field(default_factory=dict)
    prompt_tokens: Count = field(default_factory=Count)
    completion_tokens: Count = field(default_factory=Count)


@dataclass
class Moves:
    """Calls that went to another bucket than their trajectory's last one."""

    promotions: Count = field(default_factory=Count)  # to a shorter bucket
    demotions: Count = field(default_factory=Count)


class GatewayMetrics:
    """The metrics of one gateway, in a registry of its own (several apps per process in
    tests each count their own). Requests update plain numbers, and so do the events of
    ``bus`` (the engine's); the registry reads them when scraped. Without ``router``
    nothing is read from a fleet, and moves are not counted (the router orders the
    buckets)."""

    def __init__(self, router: Router | None = None, bus: EventBus | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.totals = Totals()
        self.router = router
        self.moves = Moves()
        self._routes: dict[str, RouteMetrics] = {}
        self._buckets: dict[tuple[str, str], BucketMetrics] = {}
        self.registry.register(_CountsCollector(self._routes, self._buckets, self.moves))
        if router is not None:
            self.registry.register(_FleetCollector(router))
        if bus is not None:
            bus.listen(self.fold)

    def route(self, name: str) -> RouteMetrics:
        """The metrics of one route."""
        metrics = self._routes.get(name)
        if metrics is None:
            metrics = self._routes[name] = RouteMetrics(name)
        return metrics

    def answered(self, route: RouteMetrics, status: int, seconds: float) -> None:
        counter = route.statuses.get(status)
        if counter is None:
            counter = route.statuses[status] = Count()
        counter.value += 1
        route.latency.observe(seconds)
        self.totals.requests += 1
        if status >= 400:
            self.totals.errors += 1

    def fold(self, event: Event) -> None:
        """Count one published event (the bus calls this as it publishes)."""
        if type(event) is CallEnded:
            self._called(event)
        elif type(event) is BucketMoved and self.router is not None:
            order = {bucket.name: bucket.index for bucket in self.router.buckets}
            source, target = order.get(event.source), order.get(event.target)
            if source is not None and target is not None:
                (self.moves.promotions if target < source else self.moves.demotions).inc()

    def _called(self, call: CallEnded) -> None:
        counts = self._buckets.get((call.bucket, call.instance))
        if counts is None:
            counts = self._buckets[call.bucket, call.instance] = BucketMetrics()
        outcome = counts.calls.get(call.outcome)
        if outcome is None:
            outcome = counts.calls[call.outcome] = Count()
        outcome.value += 1
        counts.prompt_tokens.value += call.prompt_tokens
        counts.completion_tokens.value += call.new_tokens
        self.totals.prompt_tokens += call.prompt_tokens
        self.totals.completion_tokens += call.new_tokens

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _CountsCollector(Collector):
    """The requests' and the events' counts, as Prometheus metrics."""

    def __init__(
        self,
        routes: dict[str, RouteMetrics],
        buckets: dict[tuple[str, str], BucketMetrics],
        moves: Moves,
    ) -> None:
        self.routes = routes
        self.buckets = buckets
        self.moves = moves

    def collect(self) -> Iterator[Metric]:
        yield from self._per_route()
        calls = CounterMetricFamily(
            "libra_gateway_bucket_requests",
            "Generation calls upstream by bucket, endpoint and outcome (ok; migrated: cut "
            "short by a pause or drain, and continued; failed; rejected; cancelled)",
            labels=["bucket", "endpoint", "outcome"],
        )
        tokens = CounterMetricFamily(
            "libra_gateway_tokens", "Tokens by bucket and kind (prompt, completion)",
            labels=["bucket", "kind"],
        )  # fmt: skip
        totals: dict[tuple[str, str], float] = {}
        for (bucket, endpoint), counts in self.buckets.items():
            for outcome, count in counts.calls.items():
                calls.add_metric([bucket, endpoint, outcome], count.value)
            for kind, count in (
                ("prompt", counts.prompt_tokens),
                ("completion", counts.completion_tokens),
            ):
                totals[bucket, kind] = totals.get((bucket, kind), 0.0) + count.value
        for labels, value in totals.items():
            tokens.add_metric(list(labels), value)
        yield calls
        yield tokens
        yield CounterMetricFamily(
            "libra_gateway_promotions",
            "Calls that went to a shorter bucket than their trajectory's last one",
            self.moves.promotions.value,
        )
        yield CounterMetricFamily(
            "libra_gateway_demotions",
            "Calls that went to a longer bucket than their trajectory's last one",
            self.moves.demotions.value,
        )

    def _per_route(self) -> Iterator[Metric]:
        requests = CounterMetricFamily(
            "libra_gateway_requests", "Requests answered, by route and status",
            labels=["route", "status"],
        )  # fmt: skip
        latency = HistogramMetricFamily(
            "libra_gateway_request_seconds", "Whole requests, by route", labels=["route"]
        )
        core_latency = HistogramMetricFamily(
            "libra_gateway_core_seconds", "Time in the core (generation), by route",
            labels=["route"],
        )  # fmt: skip
        in_progress = GaugeMetricFamily(
            "libra_gateway_requests_in_progress", "Requests being answered, by route",
            labels=["route"],
        )  # fmt: skip
        disconnects = CounterMetricFamily(
            "libra_gateway_disconnects", "Requests whose client left before the answer",
            labels=["route"],
        )  # fmt: skip
        for name, route in self.routes.items():
            for status, count in route.statuses.items():
                requests.add_metric([name, str(status)], count.value)
            latency.add_metric([name], route.latency.buckets(), route.latency.sum)
            core_latency.add_metric([name], route.core_latency.buckets(), route.core_latency.sum)
            in_progress.add_metric([name], route.in_progress.value)
            disconnects.add_metric([name], route.disconnects.value)
        yield from (requests, latency, core_latency, in_progress, disconnects)


class _FleetCollector(Collector):
    """Read when scraped: the router's live load."""

    def __init__(self, router: Router) -> None:
        self.router = router

    def collect(self) -> Iterator[Metric]:
        labels = ["endpoint", "bucket"]
        in_flight = GaugeMetricFamily(
            "libra_gateway_upstream_in_flight",
            "Calls in flight per upstream endpoint",
            labels=labels,
        )
        queued = GaugeMetricFamily(
            "libra_gateway_upstream_queue_depth",
            "Calls waiting for a batch slot per upstream endpoint (vLLM's gauge if polled, "
            "else the router's estimate)",
            labels=labels,
        )
        for instance in self.router.instances:
            in_flight.add_metric([instance.name, instance.bucket], instance.in_flight)
            queued.add_metric([instance.name, instance.bucket], instance.queued)
        yield in_flight
        yield queued
