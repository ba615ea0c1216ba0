"""What the router knows of one instance (its live load, membership and health, and the
capacity and queue they imply) and of a bucket of instances."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from libra.fleet import Endpoint, InstanceSpec, StepCost
from libra.sched._wakeups import Latch

InstanceState = Literal["active", "draining", "gone"]


@dataclass(eq=False)
class Instance:
    """One instance and its live load, as the router sees it.

    ``state`` is its membership: ``active`` takes calls; ``draining`` takes no new ones
    and sets ``drained`` when its last call in flight is released; ``gone`` has left the
    router. Only membership changes it, never a call's outcome. ``marked_down`` is an
    outside health check's verdict; ``down_until`` the cooldown after failed calls.
    """

    spec: InstanceSpec
    endpoint: Endpoint
    bucket: str
    state: InstanceState = "active"
    drained: Latch = field(default_factory=Latch)
    marked_down: bool = False
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
        return self.marked_down or now < self.down_until

    def cooling_down(self, now: float) -> bool:
        """Avoided after failed calls, but not known to be gone."""
        return not self.marked_down and now < self.down_until


@dataclass(eq=False)
class Bucket:
    """A level: instances for trajectories expected to need up to ``max_tokens`` more."""

    name: str
    max_tokens: int
    instances: list[Instance]
    index: int  # 0 is the shortest bucket: C-MLFQ's top level
