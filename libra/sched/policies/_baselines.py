"""The policies a user would pick instead of C-MLFQ, behind the same interface.

- :class:`RoundRobin`: the next instance in turn, blind to load.
- :class:`LeastLoadedScheduler` (verl's default): the fewest calls in flight.
- :class:`StaticPrompt`: every trajectory of a prompt on one instance, chosen by a hash
  of the prompt id (GRPO groups share their prompt's prefix cache).
- :class:`LengthPrediction`: the bucket whose ceiling covers the trajectory's predicted
  total length, from the prompt's history (StreamRL dispatches by predicted length; the
  reference's length-aware policy routes by it), least-loaded inside.
- :class:`SortedLength` (SortedRL-style): least-loaded placement, and vLLM priority by
  predicted length so that short trajectories finish first.
- :class:`PLAS` (Autellix): program-level least attained service. A trajectory's
  priority is the level of output it has already received (fewer tokens first), and
  calls of trajectories that received much stay where their KV lives.

The oracles (C-MLFQ fed the truth) live beside C-MLFQ.
"""

from __future__ import annotations

import itertools
import math
import zlib
from collections.abc import Callable, Sequence
from typing import ClassVar

from libra.fleet import Endpoint
from libra.sched._buckets import Instance, Router
from libra.sched._protocol import RouteRequest
from libra.sched.policies._base import Choice, RoutedPolicy, Track
from libra.sched.policies._predict import PromptHistoryPredictor


class RoundRobin(RoutedPolicy):
    name: ClassVar[str] = "round-robin"

    def __init__(self, router: Router) -> None:
        super().__init__(router)
        self._turn = itertools.count()

    def choose(self, request: RouteRequest, track: Track, exclude: frozenset[str]) -> Choice:
        instances = self.router.instances
        available = self.router.usable(exclude)
        start = next(self._turn)
        for offset in range(len(instances)):
            instance = instances[(start + offset) % len(instances)]
            if instance in available:
                return Choice(instance, None, "next")
        raise AssertionError("unreachable: usable() raised if none is available")


class LeastLoadedScheduler(RoutedPolicy):
    """The fewest calls in flight. Ties go to the instance that served the trajectory's
    previous turn (its prefix is cached there), then in turn order, so an idle fleet is
    filled evenly. Libra's default until buckets are configured."""

    name: ClassVar[str] = "least-loaded"

    def __init__(self, fleet: Router | Sequence[Endpoint]) -> None:
        """``fleet``: a router, or endpoints (a one-bucket router over those objects)."""
        super().__init__(fleet if isinstance(fleet, Router) else Router.over(fleet))
        self._turn = itertools.count()

    def choose(self, request: RouteRequest, track: Track, exclude: frozenset[str]) -> Choice:
        candidates = sorted(self.router.usable(exclude), key=self._fleet_order())
        start = next(self._turn) % len(candidates)
        rotated = candidates[start:] + candidates[:start]
        previous = self.router.instance_of(request.previous)
        instance = min(rotated, key=lambda i: (i.in_flight, i is not previous))
        return Choice(instance, None, "least_loaded")

    def _fleet_order(self) -> Callable[[Instance], int]:
        """Turns go in the fleet's instance order (the router keeps bucket order), then
        instances that joined since: blind to buckets, as this policy is."""
        order = {spec.name: index for index, spec in enumerate(self.router.fleet.instances)}
        return lambda instance: order.get(instance.name, len(order))


class StaticPrompt(RoutedPolicy):
    name: ClassVar[str] = "static-prompt"

    def choose(self, request: RouteRequest, track: Track, exclude: frozenset[str]) -> Choice:
        instances = self.router.instances
        available = self.router.usable(exclude)
        start = zlib.crc32(request.prompt_id.encode())  # stable across processes
        for offset in range(len(instances)):
            instance = instances[(start + offset) % len(instances)]
            if instance in available:
                return Choice(instance, None, "prompt_hash" if offset == 0 else "next_up")
        raise AssertionError("unreachable: usable() raised if none is available")


class LengthPrediction(RoutedPolicy):
    """Route a trajectory, for its whole life, by its predicted total output length."""

    name: ClassVar[str] = "length-pred"

    def __init__(self, router: Router, predictor: PromptHistoryPredictor | None = None) -> None:
        super().__init__(router)
        self.predictor = predictor or PromptHistoryPredictor()
        self.bucket_by_trajectory: dict[str, str] = {}

    def choose(self, request: RouteRequest, track: Track, exclude: frozenset[str]) -> Choice:
        router = self.router
        name = self.bucket_by_trajectory.get(track.trajectory_id)
        bucket = router.bucket_of.get(name) if name is not None else None
        reason = "predicted"
        if bucket is None:  # its first call, or its bucket left the fleet
            total, samples = self.predictor.total(track.prompt_id)
            bucket = router.bucket_for_tokens(total) if samples else router.shortest
            self.bucket_by_trajectory[track.trajectory_id] = bucket.name
            reason = "predicted" if samples else "no_history"
        instance, how = router.pick(bucket, request, exclude)
        return Choice(instance, None, reason if how == "ok" else f"{reason}+{how}")

    def learn(self, track: Track, output_tokens: int) -> None:
        self.predictor.learn(track, output_tokens)

    def on_finish(
        self, trajectory_id: str, prompt_id: str, *, output_tokens: int, failed: bool = False
    ) -> None:
        self.bucket_by_trajectory.pop(trajectory_id, None)  # failed ones too: no leak
        super().on_finish(trajectory_id, prompt_id, output_tokens=output_tokens, failed=failed)


class SortedLength(RoutedPolicy):
    """Least-loaded placement; shorter predicted trajectories run first."""

    name: ClassVar[str] = "sorted"

    def __init__(
        self,
        router: Router,
        predictor: PromptHistoryPredictor | None = None,
        *,
        priority_tokens: int = 256,
    ) -> None:
        super().__init__(router)
        self.predictor = predictor or PromptHistoryPredictor()
        self.priority_tokens = priority_tokens

    def choose(self, request: RouteRequest, track: Track, exclude: frozenset[str]) -> Choice:
        total, samples = self.predictor.total(track.prompt_id)
        previous = self.previous_instance(request, track)
        instance = self.router.least_loaded(self.router.usable(exclude), previous)
        priority = int(total // self.priority_tokens) if samples else 0
        return Choice(instance, priority, "shortest_first" if samples else "no_history")

    def learn(self, track: Track, output_tokens: int) -> None:
        self.predictor.learn(track, output_tokens)


class PLAS(RoutedPolicy):
    """Autellix's program-level least attained service, with locality for long programs.

    Priority level ``floor(log2(1 + attained / quantum_tokens))``: a trajectory drops a
    level each time its output doubles, so new and short ones overtake long-running ones.
    A trajectory past ``locality_tokens`` stays on its instance (its KV is there) unless
    that instance is down or full; others go to the least loaded instance.
    """

    name: ClassVar[str] = "plas"

    def __init__(
        self, router: Router, *, quantum_tokens: int = 512, locality_tokens: int = 2048
    ) -> None:
        super().__init__(router)
        self.quantum_tokens = quantum_tokens
        self.locality_tokens = locality_tokens

    def choose(self, request: RouteRequest, track: Track, exclude: frozenset[str]) -> Choice:
        attained = track.generated
        level = int(math.log2(1 + attained / self.quantum_tokens))
        available = self.router.usable(exclude)
        previous = self.previous_instance(request, track)
        if (
            attained >= self.locality_tokens
            and previous in available
            and previous is not None
            and not self.router.is_full(previous)
        ):
            return Choice(previous, level, "locality")
        instance = self.router.least_loaded(available, previous)
        return Choice(instance, level, "least_loaded")
