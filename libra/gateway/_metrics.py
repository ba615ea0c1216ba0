"""The gateway's Prometheus metrics (``/metrics``) and the figures of its console line.

Counted by the surface as requests go by: requests by route and status, requests and
tokens per bucket, the latency of whole requests and of the time spent in the core,
requests in progress. Read from the scheduler when scraped: calls in flight and queue
depth per upstream endpoint, and (for a policy that logs its decisions' reasons, as
C-MLFQ does) promotions and demotions between buckets.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

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


@dataclass
class RouteMetrics:
    """One route's labelled metrics (a label lookup costs more than the update)."""

    name: str
    in_progress: Gauge
    disconnects: Counter
    latency: Histogram
    core_latency: Histogram
    statuses: dict[int, Counter] = field(default_factory=dict)


class GatewayMetrics:
    """The metrics of one gateway, in a registry of its own (several apps per process in
    tests each count their own)."""

    def __init__(self, router: Router | None = None, reasons: Reasons | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.totals = Totals()
        registry = self.registry
        self.requests = Counter(
            "libra_gateway_requests", "Requests answered, by route and status",
            ["route", "status"], registry=registry,
        )  # fmt: skip
        self.bucket_requests = Counter(
            "libra_gateway_bucket_requests", "Generation requests by bucket and endpoint",
            ["bucket", "endpoint"], registry=registry,
        )  # fmt: skip
        self.tokens = Counter(
            "libra_gateway_tokens", "Tokens by bucket and kind (prompt, completion)",
            ["bucket", "kind"], registry=registry,
        )  # fmt: skip
        self.latency = Histogram(
            "libra_gateway_request_seconds", "Whole requests, by route",
            ["route"], buckets=_LATENCY_BUCKETS, registry=registry,
        )  # fmt: skip
        self.core_latency = Histogram(
            "libra_gateway_core_seconds", "Time in the core (generation), by route",
            ["route"], buckets=_LATENCY_BUCKETS, registry=registry,
        )  # fmt: skip
        self.in_progress = Gauge(
            "libra_gateway_requests_in_progress", "Requests being answered, by route",
            ["route"], registry=registry,
        )  # fmt: skip
        self.disconnects = Counter(
            "libra_gateway_disconnects", "Requests whose client left before the answer",
            ["route"], registry=registry,
        )  # fmt: skip
        self._routes: dict[str, RouteMetrics] = {}
        self._buckets: dict[tuple[str, str], tuple[Counter, Counter, Counter]] = {}
        if router is not None:
            registry.register(_FleetCollector(router, reasons))

    def route(self, name: str) -> RouteMetrics:
        """The metrics of one route, their labels looked up once."""
        metrics = self._routes.get(name)
        if metrics is None:
            metrics = self._routes[name] = RouteMetrics(
                name,
                self.in_progress.labels(name),
                self.disconnects.labels(name),
                self.latency.labels(name),
                self.core_latency.labels(name),
            )
        return metrics

    def answered(self, route: RouteMetrics, status: int, seconds: float) -> None:
        counter = route.statuses.get(status)
        if counter is None:
            counter = route.statuses[status] = self.requests.labels(route.name, str(status))
        counter.inc()
        route.latency.observe(seconds)
        self.totals.requests += 1
        if status >= 400:
            self.totals.errors += 1

    def generated(self, bucket: str, endpoint: str, prompt: int, completion: int) -> None:
        counters = self._buckets.get((bucket, endpoint))
        if counters is None:
            counters = self._buckets[bucket, endpoint] = (
                self.bucket_requests.labels(bucket, endpoint),
                self.tokens.labels(bucket, "prompt"),
                self.tokens.labels(bucket, "completion"),
            )
        requests, prompt_tokens, completion_tokens = counters
        requests.inc()
        prompt_tokens.inc(prompt)
        completion_tokens.inc(completion)
        self.counted(prompt, completion)

    def counted(self, prompt: int, completion: int) -> None:
        """Tokens of a call whose bucket is not known (a stateless completion)."""
        self.totals.prompt_tokens += prompt
        self.totals.completion_tokens += completion

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _FleetCollector(Collector):
    """Read when scraped: the router's live load, and the policy's moves so far."""

    def __init__(self, router: Router, reasons: Reasons | None) -> None:
        self.router = router
        self.reasons = reasons

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
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
