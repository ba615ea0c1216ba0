"""Tasks and the ids of their runs, as typed values.

A :class:`Task` is what an env is reset with: a typed :class:`TaskId` (the env and a key
unique within it: a seed, a dataset row's id), the seed, and an optional payload (a
dataset row). A trajectory is sample ``sample`` of a task at RL step ``step``: its
:class:`TrajectoryId`. The samples of one task at one step form a GRPO group
(:class:`GroupId`).

Every id renders itself as a string (``str(id)``) for records, logs and the scheduler's
keys; the string is written in one place, here, and nothing parses it back: code that
needs the env, the step or the sample reads the fields.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True, order=True)
class TaskId:
    """Which task: its env's name and a key unique within that env."""

    env: str
    key: str

    def __str__(self) -> str:
        return f"{self.env}/{self.key}"


@dataclass(frozen=True, slots=True)
class Task:
    """One task: the same task always gives the same prompt (GRPO samples it several
    times). ``payload`` is free-form data for envs driven by a dataset (a row); envs
    that build their task from a seed ignore it."""

    id: TaskId
    seed: int = 0
    payload: Mapping[str, Any] | None = None

    def __hash__(self) -> int:  # by id: a payload (a dict) is not hashable
        return hash(self.id)

    @classmethod
    def from_seed(cls, env: str, seed: int) -> Task:
        """The task of a seeded env: keyed by its seed."""
        return cls(TaskId(env, str(seed)), seed)


@dataclass(frozen=True, slots=True, order=True)
class GroupId:
    """The samples of one task at one RL step: a GRPO group."""

    step: int
    task: TaskId

    def __str__(self) -> str:
        return f"{self.task}@{self.step}"


@dataclass(frozen=True, slots=True, order=True)
class TrajectoryId:
    """Sample ``sample`` of task ``task`` at RL step ``step``: unique within a run as
    long as steps are numbered apart (the same task may come back at every step)."""

    step: int
    task: TaskId
    sample: int

    @property
    def group(self) -> GroupId:
        return GroupId(self.step, self.task)

    def __str__(self) -> str:
        return f"{self.task}#{self.sample}@{self.step}"
