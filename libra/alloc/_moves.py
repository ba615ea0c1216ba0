"""What a hybrid pool moves and remembers: units of workers and where they are, each
worker's states and transitions, and each unit's move with its outcome."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import anyio

from libra.alloc._layout import instance_name
from libra.alloc._protocol import JoinState, Role, Stage

WorkerState = Literal[
    "starting",  # its instance is loading
    "serving",  # its instance is in the router
    "draining",  # its instance takes no new calls; the ones in flight finish
    "stopping",  # its instance is shutting down
    "requested",
    "fetching_state",
    "zero_sync",
    "activating",
    "active",
    "leaving",  # it stops training
    "lost",  # a move failed and so did the way back: it is out of the pool
]
JOIN_STATES: tuple[JoinState, ...] = (
    "requested",
    "fetching_state",
    "zero_sync",
    "activating",
    "active",
)
Outcome = Literal["pending", "done", "returned", "lost"]
Direction = Literal["borrow", "release"]


@dataclass(eq=False)
class Unit:
    """The workers of one instance, and where they are."""

    workers: tuple[int, ...]
    role: Role
    stage: Stage
    bucket: str = ""  # the bucket its instance serves in (or served in, before it left)
    moving: bool = False

    @property
    def name(self) -> str:
        return instance_name(self.workers)


@dataclass(frozen=True, slots=True)
class Transition:
    at: float
    worker: int
    state: WorkerState
    note: str = ""
    #: An event in the state (a failed try, a cut drain), not a change of it.
    remark: bool = False


@dataclass(eq=False)
class Move:
    """One unit's move; ``finished`` is set when it is over, whatever its outcome."""

    unit: str
    direction: Direction
    started: float
    ended: float | None = None
    outcome: Outcome = "pending"
    error: str = ""
    finished: anyio.Event = field(default_factory=anyio.Event)


class MoveFailed(RuntimeError):
    pass
