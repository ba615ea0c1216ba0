"""Buckets of instances and the router that tracks their live load: the live fleet.

The router knows, for every instance, the calls in flight and their prompt tokens, the
trajectories that live there between turns (their prefix is cached there), whether it
failed recently, and optionally vLLM's own ``/metrics`` gauges. Policies ask it for
the least-loaded instance of a bucket (staying on a trajectory's previous instance
when that is nearly as good), and it falls back to the nearest other bucket when every
instance of the wanted one is full or down.

It is also the one registry of endpoints: instances and buckets are added, drained and
removed here while trajectories run (:meth:`Router.apply` moves to a new
:class:`~libra.fleet.FleetSpec`), and whoever syncs weights bumps
``router.endpoints()[name].weight_version``, the object routing hands to the engine.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

from libra._clock import now
from libra.fleet import Endpoint, FleetSpec, InstanceSpec
from libra.sched._instance import Bucket, Instance
from libra.sched._protocol import CallOutcome, NoEndpointAvailable, Route, RouteRequest
from libra.sched._wakeups import Latch, Pulse

Clock = Callable[[], float]
Listener = Callable[["Instance"], None]


def event_loop_clock() -> float:
    """The event loop's clock (virtual under trio's mock clock), else monotonic."""
    return now()


class Router:
    """Live load of every instance; picks instances inside a bucket, with fallbacks; adds,
    drains and removes instances and buckets while calls are in flight."""

    def __init__(
        self,
        fleet: FleetSpec,
        *,
        clock: Clock = event_loop_clock,
        endpoints: Sequence[Endpoint] = (),
    ) -> None:
        """``endpoints``: objects to use for the instances of the same name (whoever made
        them keeps seeing what the router hands out); the others are made from the spec."""
        self.fleet = fleet
        self.clock = clock
        self.instances: list[Instance] = []
        self.buckets: list[Bucket] = []
        self.by_name: dict[str, Instance] = {}
        self.bucket_of: dict[str, Bucket] = {}
        self.home: dict[str, Instance] = {}  # trajectory -> instance of its last call
        self.listeners: list[Listener] = []  # told when an instance stops taking calls
        self.membership = Pulse()  # fires when an instance becomes usable
        self._in_flight_tokens: dict[int, int] = {}  # id(route) -> prompt tokens it added
        given = {endpoint.name: endpoint for endpoint in endpoints}
        specs = {spec.name: spec for spec in fleet.instances}
        for bucket_spec in fleet.buckets:
            self.add_bucket(bucket_spec.name, bucket_spec.max_tokens)
            for name in bucket_spec.instances:
                self.add_instance(specs[name], bucket_spec.name, given.get(name))

    @classmethod
    def over(cls, endpoints: Sequence[Endpoint], *, clock: Clock = event_loop_clock) -> Router:
        """One bucket holding ``endpoints`` (the very objects), in their order."""
        if not endpoints:
            raise ValueError("a fleet needs at least one endpoint")
        specs = [InstanceSpec(name=e.name, url=e.url, model=e.model, api=e.api) for e in endpoints]
        return cls(FleetSpec(instances=specs), clock=clock, endpoints=endpoints)

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

    def endpoints(self) -> dict[str, Endpoint]:
        """The endpoint of every instance in the router (draining ones included), by name."""
        return {instance.name: instance.endpoint for instance in self.instances}

    def instance_of(self, endpoint: Endpoint | None) -> Instance | None:
        """The live instance serving ``endpoint`` (by name, at the same URL)."""
        if endpoint is None:
            return None
        instance = self.by_name.get(endpoint.name)
        if instance is None or instance.endpoint.url != endpoint.url:
            return None
        return instance

    def available(self, exclude: frozenset[str] = frozenset()) -> list[Instance]:
        """Active instances not excluded by the caller and not down.

        An instance cooling down after failed calls is avoided while another is usable;
        when all are cooling down they are all tried again: the engine's retries with
        backoff decide when a call gives up, not the cooldown.
        """
        now = self.clock()
        usable = [
            instance
            for instance in self.instances
            if instance.state == "active"
            and instance.name not in exclude
            and not instance.marked_down
        ]
        healthy = [instance for instance in usable if not instance.cooling_down(now)]
        return healthy or usable

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
        loaded of all. Raises :class:`NoEndpointAvailable` when none is usable.
        """
        available = self.usable(exclude)
        previous = self.instance_of(request.previous)
        for candidate_bucket, reason in self._fallback_order(bucket):
            room = [i for i in candidate_bucket.instances if i in available and not self.is_full(i)]
            if room:
                return self.least_loaded(room, previous), reason
        return self.least_loaded(available, previous), "all_full"

    def usable(self, exclude: frozenset[str] = frozenset()) -> list[Instance]:
        """:meth:`available`, or :class:`NoEndpointAvailable` when there is none."""
        available = self.available(exclude)
        if not available:
            raise NoEndpointAvailable(
                f"none of {len(self.instances)} instances is usable: {self._states()}"
            )
        return available

    def _states(self) -> str:
        if not self.instances:
            return "the fleet is empty"
        return ", ".join(f"{i.name} {'down' if i.marked_down else i.state}" for i in self.instances)

    def _fallback_order(self, bucket: Bucket) -> Iterable[tuple[Bucket, str]]:
        yield bucket, "ok"
        for distance in range(1, len(self.buckets)):
            for index in (bucket.index + distance, bucket.index - distance):
                if 0 <= index < len(self.buckets):
                    yield self.buckets[index], f"fallback_from_{bucket.name}"

    # ------------------------------------------------------------------ accounting

    def acquire(
        self,
        instance: Instance,
        request: RouteRequest,
        priority: int | None = None,
        max_tokens: int | None = None,
    ) -> Route:
        """Count a call on ``instance`` and make its route (with the weights it has now)."""
        endpoint = instance.endpoint
        route = Route(
            endpoint,
            priority,
            instance.bucket,
            request.trajectory_id,
            weight_version=endpoint.weight_version,
            instance=instance,
            max_tokens=max_tokens,
        )
        instance.in_flight += 1
        instance.in_flight_tokens += request.context_tokens
        self._in_flight_tokens[id(route)] = request.context_tokens
        self._move_home(request.trajectory_id, instance)
        return route

    def release(self, route: Route, *, outcome: CallOutcome) -> None:
        """The call is over: uncount it from the incarnation that counted it. Only a
        ``failed`` call marks the instance failed; an ``ok`` one ends its cooldown."""
        if id(route) not in self._in_flight_tokens:
            return  # released already, or routed by another router
        tokens = self._in_flight_tokens.pop(id(route))
        instance = route.instance
        if instance is None:
            return
        instance.in_flight = max(0, instance.in_flight - 1)
        instance.in_flight_tokens = max(0, instance.in_flight_tokens - tokens)
        if instance.state != "active":
            if instance.in_flight == 0:
                instance.drained.set()
            return
        if outcome == "ok" and instance.failures:
            instance.failures = 0
            instance.down_until = -math.inf
        elif outcome == "failed":
            self.mark_failed(instance)

    def mark_failed(self, instance: Instance) -> None:
        """Avoid ``instance`` for a while: the cooldown doubles with each failure in a row."""
        instance.failures += 1
        cooldown = self.fleet.down_cooldown_s * 2 ** min(instance.failures - 1, 6)
        instance.down_until = self.clock() + cooldown

    def mark_down(self, name: str, down: bool = True) -> None:
        """An outside health check says ``name`` is down (or back); calls' outcomes never
        undo it."""
        instance = self.by_name[name]
        instance.marked_down = down
        instance.failures = 0
        instance.down_until = -math.inf
        if not down:
            self.membership.fire()

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

    # ------------------------------------------------------------------ membership

    def add_bucket(self, name: str, max_tokens: int) -> Bucket:
        """An empty bucket (buckets stay ordered shortest first)."""
        if name in self.bucket_of:
            raise ValueError(f"bucket {name!r} exists")
        bucket = Bucket(name, max_tokens, [], 0)
        self.buckets.append(bucket)
        self.bucket_of[name] = bucket
        self._order_buckets()
        return bucket

    def remove_bucket(self, name: str) -> None:
        """Remove an empty bucket (drain and remove its instances first)."""
        bucket = self.bucket_of[name]
        if bucket.instances:
            raise ValueError(f"bucket {name!r} still holds {len(bucket.instances)} instances")
        del self.bucket_of[name]
        self.buckets.remove(bucket)
        self._order_buckets()

    def add_instance(
        self, spec: InstanceSpec, bucket: str, endpoint: Endpoint | None = None
    ) -> Instance:
        """A new active instance in ``bucket``; trajectories waiting for capacity wake."""
        live = self.by_name.get(spec.name)
        if live is not None:
            raise ValueError(f"instance {spec.name!r} is {live.state}; remove it first")
        instance = Instance(spec, endpoint or spec.endpoint(), bucket)
        self.bucket_of[bucket].instances.append(instance)
        self.instances.append(instance)
        self.by_name[spec.name] = instance
        self.membership.fire()
        return instance

    def drain(self, name: str) -> Latch:
        """Stop routing to ``name``; its residents lose their home (their prefix is cached
        nowhere usable). The latch is set when its last call in flight is released."""
        instance = self.by_name[name]
        if instance.state == "active":
            instance.state = "draining"
            self._evict(instance)
        if instance.in_flight == 0:
            instance.drained.set()
        return instance.drained

    def remove(self, name: str, *, force: bool = False) -> None:
        """Take ``name`` out of the router: once drained, or now with ``force`` (its calls
        in flight release harmlessly against the gone incarnation)."""
        instance = self.by_name[name]
        if instance.in_flight and not force:
            raise ValueError(f"{name!r} has {instance.in_flight} calls in flight: drain it")
        self.drain(name)
        instance.state = "gone"
        instance.drained.set()
        del self.by_name[name]
        self.instances.remove(instance)
        bucket = self.bucket_of.get(instance.bucket)
        if bucket is not None and instance in bucket.instances:
            bucket.instances.remove(instance)

    async def retire(self, name: str) -> None:
        """Drain ``name``, wait for its last call, remove it."""
        await self.drain(name).wait()
        if self.by_name.get(name) is not None and self.by_name[name].state == "draining":
            self.remove(name)

    def apply(self, fleet: FleetSpec) -> dict[str, Latch]:
        """Move to ``fleet``: add what is new, keep live instances (and their load) that
        stay, move them between buckets, drain those that left. Returns the drains, by
        instance name: await them and :meth:`remove` (or :meth:`retire` them). An instance
        kept under a changed URL, model or API is a new server: give it a new name."""
        wanted = {spec.name: spec for spec in fleet.instances}
        for name, spec in wanted.items():  # check it all before changing anything
            live = self.by_name.get(name)
            if live is not None and _serves_elsewhere(live.spec, spec):
                raise ValueError(f"{name!r} changes server; drain it and add a new name")
            if live is not None and live.state != "active":
                raise ValueError(f"{name!r} is draining: remove it before adding it back")
        self.fleet = fleet
        for bucket_spec in fleet.buckets:
            self._apply_bucket(bucket_spec.name, bucket_spec.max_tokens)
            for name in bucket_spec.instances:
                self._apply_instance(wanted[name], bucket_spec.name)
        drains = {
            instance.name: self.drain(instance.name)
            for instance in list(self.instances)
            if instance.name not in wanted and instance.state == "active"
        }
        for bucket in list(self.buckets):
            if bucket.name not in {b.name for b in fleet.buckets}:
                self._drop_bucket(bucket)
        self._order_buckets()
        return drains

    def _apply_bucket(self, name: str, max_tokens: int) -> None:
        bucket = self.bucket_of.get(name)
        if bucket is None:
            self.add_bucket(name, max_tokens)
        else:
            bucket.max_tokens = max_tokens

    def _apply_instance(self, spec: InstanceSpec, bucket: str) -> None:
        live = self.by_name.get(spec.name)
        if live is None:
            self.add_instance(spec, bucket)
            return
        live.spec = spec
        if live.bucket != bucket:
            old = self.bucket_of.get(live.bucket)
            if old is not None:
                old.instances.remove(live)
            self.bucket_of[bucket].instances.append(live)
            live.bucket = bucket

    def _drop_bucket(self, bucket: Bucket) -> None:
        """A bucket the new fleet lacks: its instances left with it (they are draining)."""
        for instance in bucket.instances:
            assert instance.state != "active", "apply moved or drained every member"
        bucket.instances.clear()
        self.remove_bucket(bucket.name)

    def _order_buckets(self) -> None:
        self.buckets.sort(key=lambda bucket: bucket.max_tokens)
        for index, bucket in enumerate(self.buckets):
            bucket.index = index

    def _evict(self, instance: Instance) -> None:
        """``instance`` takes no more calls: its residents need a new home, and the
        policies forget it."""
        for trajectory_id in instance.residents:
            if self.home.get(trajectory_id) is instance:
                del self.home[trajectory_id]
        instance.residents.clear()
        for listener in list(self.listeners):
            listener(instance)


def _serves_elsewhere(old: InstanceSpec, new: InstanceSpec) -> bool:
    return (old.url, old.model, old.api) != (new.url, new.model, new.api)
