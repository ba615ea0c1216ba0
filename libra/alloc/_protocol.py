"""What the allocation loop, the planner and the worker pool say to each other.

The loop observes rollout and training (:class:`CallTiming` for every generation call,
:class:`StepTiming` for every RL step), hands what it saw to a :class:`Planner`, and when
the planner's :class:`Plan` beats the current one by enough, drives the worker pool to it.
The planner sees only these observations and the :class:`Demand` summary: never an
emulator, never a benchmark (an import-linter contract), so a benchmark that grades it
with a richer emulated truth is a fair one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from itertools import compress
from typing import TYPE_CHECKING, Literal, Protocol

if TYPE_CHECKING:
    from libra.engine import TrajectoryRecord

Stage = Literal["rollout", "training"]
"""Where a worker's accelerators are in use."""

Role = Literal["core-rollout", "core-training", "hybrid"]
"""A core worker stays in its stage; a hybrid worker moves between the two."""


@dataclass(frozen=True, slots=True)
class CallTiming:
    """One generation call as the engine saw it: what it cost on which instance."""

    instance: str
    tp: int
    prompt_tokens: int
    cached_tokens: int
    new_tokens: int
    seconds: float
    #: Calls in flight on the instance when this one was sent (its own included).
    concurrent: int = 1


@dataclass(frozen=True, slots=True)
class StepTiming:
    """One RL step as the run measured it."""

    step: int
    rollout_s: float
    train_s: float
    train_tokens: int
    train_workers: int
    rollout_workers: int
    #: Fraction of worker-seconds of the step in which a worker had nothing to do.
    idle_frac: float = 0.0


@dataclass(frozen=True, slots=True)
class Demand:
    """What the next step will ask of rollout and training, from the recent steps."""

    trajectories: int
    #: Sampled (output) tokens per trajectory, recent steps pooled: the length distribution.
    output_tokens: tuple[int, ...]
    #: Context tokens per trajectory at its end (prompt, tool outputs and output).
    context_tokens: tuple[int, ...]
    #: Turns per trajectory (each is one generation call, one prefill of the new part).
    turns: tuple[int, ...] = ()
    #: Seconds each trajectory spent in its tools (empty: unknown, none priced). A
    #: trajectory's turns wait for its tools, so the longest one's tool time is on the
    #: rollout's critical path, whatever the instances do meanwhile.
    tool_s: tuple[float, ...] = ()
    #: Per trajectory, the mean context its sampled tokens were decoded at (empty:
    #: unknown, taken as its end context less half its output). A multi-turn trajectory
    #: decodes its early turns on a short context, so its end context overstates what
    #: its decode steps read by about half the tool outputs and later prompts.
    decode_context_tokens: tuple[float, ...] = ()

    @classmethod
    def of_records(cls, records: Sequence[TrajectoryRecord], trajectories: int = 0) -> Demand:
        """What ``records`` asked of rollout and training; ``trajectories`` per step
        (0: as many as the records)."""
        return cls(
            trajectories=trajectories or len(records),
            output_tokens=tuple(sum(r.loss_mask) for r in records),
            context_tokens=tuple(len(r.token_ids) for r in records),
            turns=tuple(r.turns for r in records),
            # The longest trajectory waits on its tools between turns: a floor on rollout.
            tool_s=tuple(r.timings.tool_s for r in records),
            decode_context_tokens=tuple(decode_context(r.loss_mask) for r in records),
        )


def decode_context(loss_mask: Iterable[int]) -> float:
    """The mean position of the sampled tokens: the context each was decoded at."""
    mask = list(loss_mask)
    sampled = sum(mask)
    return sum(compress(range(len(mask)), mask)) / sampled if sampled else 0.0


@dataclass(frozen=True, slots=True)
class Prediction:
    rollout_s: float
    train_s: float
    step_s: float


@dataclass(frozen=True, slots=True)
class Plan:
    """How the workers are split: ``train_workers`` train, the rest serve as instances of
    the tensor-parallel sizes in ``rollout_tps`` (one entry per instance, largest first),
    grouped into buckets under ``bucket_ceilings`` (tokens, shortest first; empty: one
    bucket)."""

    train_workers: int
    rollout_tps: tuple[int, ...]
    bucket_ceilings: tuple[int, ...] = ()
    predicted: Prediction | None = None
    reason: str = ""
    notes: dict[str, float] = field(default_factory=dict)

    @property
    def rollout_workers(self) -> int:
        return sum(self.rollout_tps)

    @property
    def workers(self) -> int:
        return self.train_workers + self.rollout_workers


class Planner(Protocol):
    """Chooses a split of ``workers`` for a workload, from what it has observed."""

    def observe_call(self, timing: CallTiming) -> None: ...

    def observe_step(
        self, timing: StepTiming, plan: Plan | None = None, ran: Demand | None = None
    ) -> None: ...

    def plan(self, workers: int, workload: Demand) -> Plan: ...

    def predict(
        self, plan: Plan, workload: Demand, trained_tokens: int | None = None
    ) -> Prediction: ...


JoinState = Literal["requested", "fetching_state", "zero_sync", "activating", "active"]
"""A hybrid worker joining training passes through these in order. While it fetches the
training state it contributes zero gradients, so the step never waits for it."""


class Cluster(Protocol):
    """The workers' processes as the pool drives them: local processes, Ray actors or the
    emulated cluster. Worker ids are ``0..workers - 1``; an instance is named by the pool.
    Every operation may raise (the pool returns the worker to where it was) and is
    cancellable (the pool bounds each with a timeout)."""

    @property
    def workers(self) -> int: ...

    async def start_instance(self, name: str, workers: tuple[int, ...]) -> str:
        """Start a serving instance on ``workers`` (its TP is their count) on the current
        weights; return its base URL once it answers."""
        ...

    async def stop_instance(self, name: str) -> None:
        """Stop it (the pool drained or migrated its calls first)."""
        ...

    async def fetch_state(self, worker: int) -> None:
        """Give ``worker`` the trainer's current parameters and optimizer shards."""
        ...

    async def zero_sync(self, worker: int) -> None:
        """One gradient exchange in which ``worker`` contributes zeros: it is in step."""
        ...

    async def activate(self, worker: int) -> None:
        """``worker`` takes a share of the batch from the next optimizer step on."""
        ...

    async def leave_training(self, worker: int) -> None:
        """``worker`` stops training (its share goes back to the others)."""
        ...


class StepAllocation(Protocol):
    """A run's allocation as the RL loop sees it: after each step, the step's timing and
    workload go in and the decision comes out (for the step's metrics line); around the
    rollout and the training, the verbs that let ``[alloc.tail]`` lend the hybrid units
    the rollout's tail leaves idle to the training under way."""

    def rollout_submitted(self) -> None:
        """A step's rollout was submitted: units lent to training go back to serving."""
        ...

    def training(
        self, positions: Callable[[], int], unfinished: Callable[[], int]
    ) -> AbstractAsyncContextManager[None]:
        """Wraps a step's training: ``positions()``, the input positions it trains (once
        its batch is built); ``unfinished()``, the rollout's trajectories still running."""
        ...

    def after_step(
        self,
        step: int,
        seconds: tuple[float, float],
        tokens: int,
        records: Sequence[TrajectoryRecord],
    ) -> dict[str, object]:
        """``seconds``: the step's rollout and what the rollout waits for in training;
        ``tokens`` trained. What the loop decided and where the workers are."""
        ...
