"""The policies a user would pick instead of C-MLFQ, behind the same interface.

- :class:`RoundRobin`: the next instance in turn, blind to load.
- :class:`LeastLoadedScheduler` (verl's default): the fewest calls in flight.
- :class:`LeastLoadedCapacity`: the fewest calls in flight per batch slot, so that an
  instance that runs more sequences at once (more GPUs, more KV room) takes more.
- :class:`StaticPrompt`: every trajectory of a prompt on one instance, chosen by a hash
  of the prompt id (GRPO groups share their prompt's prefix cache).
- :class:`LengthPrediction`: each trajectory's total length predicted from its prompt's
  features when it starts (length-prediction schedulers predict from the prompt, for
  prompts never seen); it runs in the bucket its prediction's rank calls for (StreamRL
  dispatches by predicted length), least-loaded inside, shortest predicted first.
- :class:`SortedLength` (SortedRL-style): least-loaded placement, and vLLM priority by
  predicted length so that short trajectories finish first.
- :class:`PLAS` (Autellix): program-level least attained service. A trajectory's
  priority is the level of output it has already received (fewer tokens first), and
  calls of trajectories that received much stay where their KV lives.

The oracles (C-MLFQ's rules fed the truth) are in ``_oracle.py``.
"""

from __future__ import annotations

import bisect
import itertools
import math
import zlib
from collections import deque
from collections.abc import Callable, Sequence
from typing import ClassVar

from libra.fleet import Endpoint, FleetSpec
from libra.sched._buckets import Router
from libra.sched._instance import Bucket, Instance
from libra.sched._protocol import RouteRequest
from libra.sched.policies._base import Choice, RoutedPolicy, Track
from libra.sched.policies._predict import FeaturePredictor, PromptHistoryPredictor


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
        self._ordered: tuple[FleetSpec, Callable[[Instance], int]] | None = None

    def choose(self, request: RouteRequest, track: Track, exclude: frozenset[str]) -> Choice:
        candidates = sorted(self.router.usable(exclude), key=self._fleet_order())
        start = next(self._turn) % len(candidates)
        rotated = candidates[start:] + candidates[:start]
        previous = self.router.instance_of(request.previous)
        instance = min(rotated, key=lambda i: (self.load(i), i is not previous))
        return Choice(instance, None, "least_loaded")

    def load(self, instance: Instance) -> float:
        """What is compared: the calls in flight."""
        return instance.in_flight

    def _fleet_order(self) -> Callable[[Instance], int]:
        """Turns go in the fleet's instance order (the router keeps bucket order), then
        instances that joined since: blind to buckets, as this policy is."""
        fleet = self.router.fleet
        if self._ordered is None or self._ordered[0] is not fleet:  # (the router moved)
            order = {spec.name: index for index, spec in enumerate(fleet.instances)}
            self._ordered = (fleet, lambda instance: order.get(instance.name, len(order)))
        return self._ordered[1]


class LeastLoadedCapacity(LeastLoadedScheduler):
    """Least-loaded weighed by each instance's size: the calls in flight per batch slot
    (the sequences its KV cache holds at the calls' mean context, at most
    ``max_num_seqs``), so that a TP4 instance takes several times a TP1's calls."""

    name: ClassVar[str] = "least-loaded-capacity"

    def load(self, instance: Instance) -> float:
        return instance.load


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
    """Route a trajectory, for its whole life, by its total output length predicted from
    its prompt's features (:class:`FeaturePredictor`) when it starts.

    Buckets are filled by the prediction's rank, not by fixed ceilings (a predictor of
    lengths from features predicts near the mean, and fixed ceilings would send nearly
    everything to one bucket): among the predictions made lately, the trajectories
    predicted shortest, holding the first share of the predicted work, go to the first
    bucket in proportion to its GPUs, and so on. Inside the bucket, least-loaded; its
    calls carry vLLM priority by predicted length, shortest first.
    """

    name: ClassVar[str] = "length-pred"

    def __init__(
        self,
        router: Router,
        predictor: FeaturePredictor | None = None,
        *,
        window: int = 1024,
        priority_tokens: int = 256,
    ) -> None:
        super().__init__(router)
        self.predictor = predictor or FeaturePredictor()
        self.priority_tokens = priority_tokens
        self.recent: deque[float] = deque(maxlen=window)  # predictions made lately
        self.placed: dict[str, tuple[str, float | None]] = {}  # bucket, predicted total

    def choose(self, request: RouteRequest, track: Track, exclude: frozenset[str]) -> Choice:
        router = self.router
        placed = self.placed.get(track.trajectory_id)
        bucket = router.bucket_of.get(placed[0]) if placed is not None else None
        predicted = placed[1] if placed is not None else None
        reason = "predicted" if predicted is not None else "no_history"
        if bucket is None:  # its first call, or its bucket left the fleet
            total, samples = self.predictor.total(track.env, track.prompt_tokens)
            predicted = total if samples else None
            bucket = self._bucket_by_rank(total) if samples else router.shortest
            self.placed[track.trajectory_id] = (bucket.name, predicted)
            reason = "predicted" if samples else "no_history"
        instance, how = router.pick(bucket, request, exclude)
        priority = int(predicted // self.priority_tokens) if predicted is not None else 0
        return Choice(instance, priority, reason if how == "ok" else f"{reason}+{how}")

    def _bucket_by_rank(self, predicted: float) -> Bucket:
        """The bucket whose share of the fleet's GPUs covers the predicted work of the
        trajectories predicted shorter than this one (and half its own)."""
        ordered = sorted(self.recent)
        self.recent.append(predicted)
        below = sum(ordered[: bisect.bisect_left(ordered, predicted)])
        total = sum(ordered) + predicted
        share = (below + predicted / 2) / total if total > 0 else 0.0
        buckets = self.router.buckets
        gpus = [sum(i.spec.tp for i in b.instances if i.state == "active") for b in buckets]
        covered = 0.0
        for bucket, size in zip(buckets, gpus, strict=True):
            covered += size / max(1, sum(gpus))
            if share < covered:
                return bucket
        return buckets[-1]

    def learn(self, track: Track, output_tokens: int) -> None:
        self.predictor.learn_total(track.env, track.prompt_tokens, output_tokens)

    def on_finish(
        self, trajectory_id: str, prompt_id: str, *, output_tokens: int, failed: bool = False
    ) -> None:
        self.placed.pop(trajectory_id, None)  # failed ones too: no leak
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
