"""The events a run publishes: what its trajectories, fleet and training loop did, as it
happened. Each is one JSON object (``kind`` names its type; ``t`` is seconds since the
run's bus started), the unit of the run's events log and of the live view's stream."""

from __future__ import annotations

from typing import Any

import msgspec


class Event(msgspec.Struct, tag_field="kind", kw_only=True, omit_defaults=True):
    t: float


class TrajectoryStarted(Event, tag="start"):
    id: str
    env: str
    step: int
    task: str


class CallEnded(Event, tag="call"):
    """One generation call: on which instance and bucket, how long, the prompt it sent
    and what it sampled (in tokens), how it ended (``libra.sched.CallOutcome``)."""

    id: str
    turn: int
    instance: str
    bucket: str
    seconds: float
    new_tokens: int
    outcome: str
    weight_version: int
    prompt_tokens: int = 0


class ToolEnded(Event, tag="tool"):
    id: str
    tool: str
    status: str  # success, failure, timeout
    seconds: float


class BucketMoved(Event, tag="move"):
    """A trajectory's call went to another bucket than its last one: C-MLFQ promoted or
    demoted it. ``tool``/``status``: the tool return it came after (none: no tool ran)."""

    id: str
    source: str
    target: str
    tool: str | None = None
    status: str | None = None


class TrajectoryEnded(Event, tag="end"):
    """``tokens``: what the model sampled in all (as the calls' ``new_tokens`` add up)."""

    id: str
    status: str
    stop_reason: str
    reward: float | None
    turns: int
    tokens: int
    seconds: float


class InstanceSample(msgspec.Struct, omit_defaults=True):
    """One serving instance: its bucket, membership (``active``, ``draining``; ``down``
    while marked down), load, and what its server reports (when polled)."""

    name: str
    bucket: str
    state: str
    in_flight: int
    weight_version: int
    waiting: float | None = None
    kv_usage: float | None = None


class FleetSampled(Event, tag="fleet"):
    instances: list[InstanceSample]


class StepEnded(Event, tag="step"):
    """A training step's line (``metrics.jsonl``), with the allocation loop's decision
    under ``alloc`` when it runs."""

    line: dict[str, Any]


class EvalEnded(Event, tag="eval"):
    line: dict[str, Any]  # eval.jsonl's


class CheckpointWritten(Event, tag="checkpoint"):
    """The checkpoint after ``steps_done`` steps is complete, in folder ``path``."""

    steps_done: int
    path: str


AnyEvent = (
    TrajectoryStarted
    | CallEnded
    | ToolEnded
    | BucketMoved
    | TrajectoryEnded
    | FleetSampled
    | StepEnded
    | EvalEnded
    | CheckpointWritten
)
