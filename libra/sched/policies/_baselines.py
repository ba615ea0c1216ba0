"""The policies a user would pick instead of C-MLFQ, behind the same interface.

- :class:`RoundRobin`: the next instance in turn, blind to load.
- least-loaded (verl's default): :class:`~libra.sched.LeastLoadedScheduler`.
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
- :class:`Oracle`: C-MLFQ's simple rule fed the true remaining length; a reference.
  :class:`OracleFinish`: Libra's ``finish`` rule fed the truth.
"""

from __future__ import annotations

import itertools
import math
import zlib
from collections.abc import Callable
from typing import ClassVar

from libra.sched._buckets import Instance, Router
from libra.sched._protocol import NoEndpointAvailable, RouteRequest
from libra.sched.policies._base import Choice, RoutedPolicy, Track
from libra.sched.policies._cmlfq import CMLFQ, CMLFQConfig
from libra.sched.policies._predict import OraclePredictor, PromptHistoryPredictor


def _available(router: Router, exclude: frozenset[str]) -> list[Instance]:
    available = router.available(exclude)
    if not available:
        raise NoEndpointAvailable(f"all {len(router.instances)} instances are down or excluded")
    return available


class RoundRobin(RoutedPolicy):
    name: ClassVar[str] = "round-robin"

    def __init__(self, router: Router) -> None:
        super().__init__(router)
        self._turn = itertools.count()

    def choose(self, request: RouteRequest, track: Track, exclude: frozenset[str]) -> Choice:
        instances = self.router.instances
        available = _available(self.router, exclude)
        start = next(self._turn)
        for offset in range(len(instances)):
            instance = instances[(start + offset) % len(instances)]
            if instance in available:
                return Choice(instance, None, "next")
        raise AssertionError("unreachable: _available raised if none is available")


class StaticPrompt(RoutedPolicy):
    name: ClassVar[str] = "static-prompt"

    def choose(self, request: RouteRequest, track: Track, exclude: frozenset[str]) -> Choice:
        instances = self.router.instances
        available = _available(self.router, exclude)
        start = zlib.crc32(request.prompt_id.encode())  # stable across processes
        for offset in range(len(instances)):
            instance = instances[(start + offset) % len(instances)]
            if instance in available:
                return Choice(instance, None, "prompt_hash" if offset == 0 else "next_up")
        raise AssertionError("unreachable: _available raised if none is available")


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
        reason = "predicted"
        if name is None:
            total, samples = self.predictor.total(track.prompt_id)
            bucket = router.bucket_for_tokens(total) if samples else router.shortest
            name = self.bucket_by_trajectory[track.trajectory_id] = bucket.name
            reason = "predicted" if samples else "no_history"
        instance, how = router.pick(router.bucket_of[name], request, exclude)
        return Choice(instance, None, reason if how == "ok" else f"{reason}+{how}")

    def learn(self, track: Track, output_tokens: int) -> None:
        self.bucket_by_trajectory.pop(track.trajectory_id, None)
        self.predictor.learn(track, output_tokens)


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
        instance = self.router.least_loaded(_available(self.router, exclude), previous)
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
        available = _available(self.router, exclude)
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


class Oracle(CMLFQ):
    """C-MLFQ's simple rule fed the true remaining length (``truth(trajectory_id)`` is
    the trajectory's total output). Knowing the truth, it needs no agreement of mean and
    p90 and places a trajectory from its first call on. A reference, not a policy."""

    name: ClassVar[str] = "oracle"

    def __init__(self, router: Router, truth: Callable[[str], int]) -> None:
        config = CMLFQConfig(rule="simple", priority="none", start_in_shortest=False)
        super().__init__(router, config, predictor=OraclePredictor(truth))


class OracleFinish(CMLFQ):
    """Libra's C-MLFQ (the ``finish`` rule, its default settings) fed the true remaining
    length: what the policy would do with a perfect predictor."""

    name: ClassVar[str] = "oracle-finish"

    def __init__(self, router: Router, truth: Callable[[str], int]) -> None:
        super().__init__(router, CMLFQConfig(), predictor=OraclePredictor(truth))
