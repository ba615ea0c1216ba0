"""One trajectory to run: an env class, a task, its sample number and its RL step, and the
ids (trajectory, group) the rest of the system keys it by."""

from __future__ import annotations

from dataclasses import dataclass

from libra.engine._config import SamplingConfig
from libra.envs import Env, GroupId, Task, TaskId, TrajectoryId


@dataclass(frozen=True, slots=True)
class TrajectoryJob:
    """One trajectory to run: sample ``sample`` of ``task`` at RL step ``step``.
    ``env_cls`` is None for a run whose episodes an agent plays (``libra.agents``) and
    that scores them with no env. ``sampling`` replaces the engine's for this job (an
    evaluation samples greedily, say)."""

    env_cls: type[Env] | None
    task: Task
    sample: int = 0
    step: int = 0
    sampling: SamplingConfig | None = None

    @classmethod
    def seeded(
        cls, env_cls: type[Env] | None, env_name: str, seed: int, sample: int = 0, step: int = 0
    ) -> TrajectoryJob:
        """A job of a seeded env: its task is keyed by ``seed``."""
        return cls(env_cls, Task.from_seed(env_name, seed), sample, step)

    @property
    def task_id(self) -> TaskId:
        return self.task.id

    @property
    def id(self) -> TrajectoryId:
        return TrajectoryId(self.step, self.task.id, self.sample)

    @property
    def group_id(self) -> GroupId:
        return GroupId(self.step, self.task.id)
