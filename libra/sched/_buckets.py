"""Buckets of instances and the router that tracks their live load.

The router knows, for every instance, the calls in flight and their prompt tokens, the
trajectories that live there between turns (their prefix is cached there), whether it
failed recently, and optionally vLLM's own ``/metrics`` gauges. Policies ask it for
the least-loaded instance of a bucket (staying on a trajectory's previous instance
when that is nearly as good), and it falls back to the nearest other bucket when every
instance of the wanted one is full or down.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import anyio

from libra.fleet import BucketSpec, Endpoint, FleetSpec, InstanceSpec, StepCost
from libra.sched._protocol import NoEndpointAvailable, Route, RouteRequest

Clock = Callable[[], float]


def event_loop_clock() -> float:
    """anyio's clock inside an event loop (virtual under a mock clock), else monotonic."""
    try:
        return anyio.current_time()
    except RuntimeError:
        return time.monotonic()


@dataclass(eq=False)
class Instance:
    """One instance and its live load, as the router sees it."""

    spec: InstanceSpec
    endpoint: Endpoint
    bucket: str
    in_flight: int = 0
    in_flight_tokens: int = 0
    residents: dict[str, None] = field(default_factory=dict)  # trajectories homed here
    failures: int = 0
    down_until: float = -math.inf
    waiting_gauge: float | None = None  # vllm:num_requests_waiting, when polled
    kv_usage_gauge: float | None = None  # vllm:kv_cache_usage_perc, when polled

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def cost(self) -> StepCost:
        return self.spec.step_cost

    @property
    def capacity(self) -> int:
        """Sequences it runs at once when its KV cache holds the calls in flight."""
        if self.in_flight == 0:
            return self.spec.max_num_seqs
        per_call = max(1.0, self.in_flight_tokens / self.in_flight)
        fits = int(self.spec.kv_capacity_tokens // per_call)
        return max(1, min(self.spec.max_num_seqs, fits))

    @property
    def queued(self) -> float:
        """Calls waiting for a batch slot: vLLM's gauge if polled, else estimated."""
        estimate = max(0, self.in_flight - self.capacity)
        if self.waiting_gauge is None:
            return estimate
        return max(self.waiting_gauge, estimate)

    @property
    def load(self) -> float:
        """Calls in flight per batch slot (what least-connections balancing compares)."""
        return self.in_flight / self.capacity

    def is_full(self, max_queue_length: int) -> bool:
        return self.queued >= max_queue_length > 0 or (
            max_queue_length == 0 and self.in_flight >= self.capacity
        )

    def is_down(self, now: float) -> bool:
        return now < self.down_until


@dataclass(eq=False)
class Bucket:
    """A level: instances for trajectories expected to need up to ``max_tokens`` more."""

    spec: BucketSpec
    instances: list[Instance]
    index: int  # 0 is the shortest bucket: C-MLFQ's top level

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def max_tokens(self) -> int:
        return self.spec.max_tokens


class Router:
    """Live load of every instance; picks instances inside a bucket, with fallbacks."""

    def __init__(self, fleet: FleetSpec, *, clock: Clock = event_loop_clock) -> None:
        self.fleet = fleet
        self.clock = clock
        self.instances: list[Instance] = []
        self.buckets: list[Bucket] = []
        by_name = {spec.name: spec for spec in fleet.instances}
        for index, bucket_spec in enumerate(fleet.buckets):
            members = [
                Instance(by_name[name], by_name[name].endpoint(), bucket_spec.name)
                for name in bucket_spec.instances
            ]
            self.instances += members
            self.buckets.append(Bucket(bucket_spec, members, index))
        self.by_name = {instance.name: instance for instance in self.instances}
        self.bucket_of = {bucket.name: bucket for bucket in self.buckets}
        self.home: dict[str, Instance] = {}  # trajectory -> instance of its last call
        self._in_flight_tokens: dict[int, int] = {}  # id(route) -> prompt tokens it added

    # ------------------------------------------------------------------ looking up

    @property
    def shortest(self) -> Bucket:
        return self.buckets[0]

    def bucket_for_tokens(self, tokens: float) -> Bucket:
        """The smallest bucket whose ceiling covers ``tokens`` (the largest if none does)."""
        for bucket in self.buckets:
            if tokens <= bucket.max_tokens:
                return bucket
        return self.buckets[-1]

    def instance_of(self, endpoint: Endpoint | None) -> Instance | None:
        return None if endpoint is None else self.by_name.get(endpoint.name)

    def available(self, exclude: frozenset[str] = frozenset()) -> list[Instance]:
        """Instances not excluded by the caller and not marked down."""
        now = self.clock()
        return [
            instance
            for instance in self.instances
            if instance.name not in exclude and not instance.is_down(now)
        ]

    def is_full(self, instance: Instance) -> bool:
        return instance.is_full(self.fleet.max_queue_length)

    # ------------------------------------------------------------------- choosing

    def least_loaded(
        self, candidates: Sequence[Instance], previous: Instance | None = None
    ) -> Instance:
        """The least-loaded candidate; the previous instance while it is nearly as good.

        Ties go to faster instances (higher TP), then to fleet order.
        """
        best = min(candidates, key=lambda i: (i.load, -i.spec.tp))
        if previous is not None and previous in candidates:
            slack = self.fleet.sticky_slack / best.capacity
            if previous.load <= best.load + slack:
                return previous
        return best

    def pick(
        self,
        bucket: Bucket,
        request: RouteRequest,
        exclude: frozenset[str] = frozenset(),
    ) -> tuple[Instance, str]:
        """An instance of ``bucket`` for the call, and why: ``"ok"``, or the fallback taken.

        Full or down instances are skipped; when the whole bucket is, the nearest bucket
        with room takes the call (the next longer first: a longer bucket serves a short
        trajectory well, the reverse less so); when every instance is full, the least
        loaded of all. Raises :class:`NoEndpointAvailable` when every one is down.
        """
        available = self.available(exclude)
        if not available:
            raise NoEndpointAvailable(f"all {len(self.instances)} instances are down or excluded")
        previous = self.instance_of(request.previous)
        for candidate_bucket, reason in self._fallback_order(bucket):
            room = [i for i in candidate_bucket.instances if i in available and not self.is_full(i)]
            if room:
                return self.least_loaded(room, previous), reason
        return self.least_loaded(available, previous), "all_full"

    def _fallback_order(self, bucket: Bucket) -> Iterable[tuple[Bucket, str]]:
        yield bucket, "ok"
        for distance in range(1, len(self.buckets)):
            for index in (bucket.index + distance, bucket.index - distance):
                if 0 <= index < len(self.buckets):
                    yield self.buckets[index], f"fallback_from_{bucket.name}"

    # ------------------------------------------------------------------ accounting

    def acquire(
        self, instance: Instance, request: RouteRequest, priority: int | None = None
    ) -> Route:
        """Count a call on ``instance`` and make its route."""
        route = Route(instance.endpoint, priority, instance.bucket, request.trajectory_id)
        instance.in_flight += 1
        instance.in_flight_tokens += request.context_tokens
        self._in_flight_tokens[id(route)] = request.context_tokens
        self._move_home(request.trajectory_id, instance)
        return route

    def release(self, route: Route, *, ok: bool) -> None:
        instance = self.by_name.get(route.endpoint.name)
        tokens = self._in_flight_tokens.pop(id(route), 0)
        if instance is None:
            return
        instance.in_flight = max(0, instance.in_flight - 1)
        instance.in_flight_tokens = max(0, instance.in_flight_tokens - tokens)
        if ok:
            instance.failures = 0
            instance.down_until = -math.inf
        else:
            self.mark_failed(instance)

    def mark_failed(self, instance: Instance) -> None:
        """Avoid ``instance`` for a while: the cooldown doubles with each failure in a row."""
        instance.failures += 1
        cooldown = self.fleet.down_cooldown_s * 2 ** min(instance.failures - 1, 6)
        instance.down_until = self.clock() + cooldown

    def mark_down(self, name: str, down: bool = True) -> None:
        """An outside health check says ``name`` is down (or back)."""
        instance = self.by_name[name]
        instance.down_until = math.inf if down else -math.inf
        instance.failures = 0

    def forget(self, trajectory_id: str) -> None:
        """The trajectory ended: it no longer lives anywhere."""
        instance = self.home.pop(trajectory_id, None)
        if instance is not None:
            instance.residents.pop(trajectory_id, None)

    def _move_home(self, trajectory_id: str, instance: Instance) -> None:
        old = self.home.get(trajectory_id)
        if old is instance:
            return
        if old is not None:
            old.residents.pop(trajectory_id, None)
        instance.residents[trajectory_id] = None
        self.home[trajectory_id] = instance
