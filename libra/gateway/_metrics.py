"""The gateway's Prometheus metrics (``/metrics``) and the figures of its console line.

Counted by the surface as requests go by: requests by route and status, requests and
tokens per bucket, the latency of whole requests and of the time spent in the core,
requests in progress. Read from the scheduler when scraped: calls in flight and queue
depth per upstream endpoint, and (for a policy that logs its decisions' reasons, as
C-MLFQ does) promotions and demotions between buckets.
"""

from __future__ import annotations

import bisect
import itertools
import time
from collections.abc import Callable, Iterator, Mapping
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

from libra.sched import Router

Reasons = Callable[[], Mapping[str, int]]
"""The scheduler's decisions so far, counted by reason (``to_shorter``: a promotion to a
shorter bucket, ``to_longer``: a demotion), e.g. C-MLFQ's ``reasons``."""

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
    """Generation requests to one endpoint in one bucket, and their tokens."""

    requests: Count = field(default_factory=Count)
    prompt_tokens: Count = field(default_factory=Count)
    completion_tokens: Count = field(default_factory=Count)


class GatewayMetrics:
    """The metrics of one gateway, in a registry of its own (several apps per process in
    tests each count their own). Requests update plain numbers; the registry reads them
    when scraped."""

    def __init__(self, router: Router | None = None, reasons: Reasons | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.totals = Totals()
        self._routes: dict[str, RouteMetrics] = {}
        self._buckets: dict[tuple[str, str], BucketMetrics] = {}
        self.registry.register(_CountsCollector(self._routes, self._buckets))
        if router is not None:
            self.registry.register(_FleetCollector(router, reasons))

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

    def generated(self, bucket: str, endpoint: str, prompt: int, completion: int) -> None:
        counts = self._buckets.get((bucket, endpoint))
        if counts is None:
            counts = self._buckets[bucket, endpoint] = BucketMetrics()
        counts.requests.value += 1
        counts.prompt_tokens.value += prompt
        counts.completion_tokens.value += completion
        self.counted(prompt, completion)

    def counted(self, prompt: int, completion: int) -> None:
        """Tokens of a call whose bucket is not known (a stateless completion)."""
        self.totals.prompt_tokens += prompt
        self.totals.completion_tokens += completion

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _CountsCollector(Collector):
    """The requests' own counts, as Prometheus metrics."""

    def __init__(
        self, routes: dict[str, RouteMetrics], buckets: dict[tuple[str, str], BucketMetrics]
    ) -> None:
        self.routes = routes
        self.buckets = buckets

    def collect(self) -> Iterator[Metric]:
        yield from self._per_route()
        requests = CounterMetricFamily(
            "libra_gateway_bucket_requests", "Generation requests by bucket and endpoint",
            labels=["bucket", "endpoint"],
        )  # fmt: skip
        tokens = CounterMetricFamily(
            "libra_gateway_tokens", "Tokens by bucket and kind (prompt, completion)",
            labels=["bucket", "kind"],
        )  # fmt: skip
        totals: dict[tuple[str, str], float] = {}
        for (bucket, endpoint), counts in self.buckets.items():
            requests.add_metric([bucket, endpoint], counts.requests.value)
            for kind, count in (
                ("prompt", counts.prompt_tokens),
                ("completion", counts.completion_tokens),
            ):
                totals[bucket, kind] = totals.get((bucket, kind), 0.0) + count.value
        for labels, value in totals.items():
            tokens.add_metric(list(labels), value)
        yield requests
        yield tokens

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
    """Read when scraped: the router's live load, and the policy's moves so far."""

    def __init__(self, router: Router, reasons: Reasons | None) -> None:
        self.router = router
        self.reasons = reasons

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
        if self.reasons is not None:
            yield from _moves(self.reasons())


def _moves(reasons: Mapping[str, int]) -> Iterator[CounterMetricFamily]:
    promotions = sum(n for reason, n in reasons.items() if reason.startswith("to_shorter"))
    demotions = sum(n for reason, n in reasons.items() if reason.startswith("to_longer"))
    yield CounterMetricFamily(
        "libra_gateway_promotions", "Calls the scheduler moved to a shorter bucket", promotions
    )
    yield CounterMetricFamily(
        "libra_gateway_demotions", "Calls the scheduler moved to a longer bucket", demotions
    )
