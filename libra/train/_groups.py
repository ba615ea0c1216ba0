"""A step's GRPO groups: its jobs submitted to the run's session, failed trajectories run
again (``train.failures = "retry"``), each record logged as it ends and gathered into its
group, and a complete group sorted to its step."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import anyio

from libra.engine import Group, RolloutSession, TrajectoryJob, TrajectoryRecord
from libra.envs import Env, GroupId
from libra.train._rollout_log import RolloutLog
from libra.train._settings import RunSettings
from libra.train._tasks import StepTasks


class GroupSource(Protocol):
    """Where a run's steps get their groups: :class:`StepGroups` (the run's own jobs),
    or ``libra.train.OnlineGroups`` (sessions agents elsewhere played)."""

    reused: dict[int, int]
    retried: dict[int, int]
    reusable: dict[int, list[TrajectoryRecord]]
    #: Per step: what ended without joining a group, by reason (the step line's too).
    dropped: defaultdict[int, Counter[str]]

    @property
    def jobs_left(self) -> int: ...

    def submit(self, step: int) -> None: ...

    async def of_step(self, step: int, tick: Callable[[], None]) -> list[Group]: ...

    async def read_records(self) -> None: ...


@dataclass
class StepGroups:
    """The groups of the run's steps, as their records come in (one reader for the run)."""

    config: RunSettings
    #: Each env of the mixture's class, by name (None: an agent plays the episodes, and
    #: no env scores them).
    env_classes: Mapping[str, type[Env] | None]
    tasks: StepTasks
    session: RolloutSession
    log: RolloutLog
    groups: dict[int, list[Group]] = field(default_factory=lambda: defaultdict(list))
    # Records of groups not complete yet, and the ids of the groups submitted, by group.
    _gathering: dict[str, list[TrajectoryRecord]] = field(default_factory=dict)
    _group_ids: dict[str, GroupId] = field(default_factory=dict)
    # The jobs submitted and not yet recorded (a failed one may run again), and the runs
    # again of each step's failed trajectories.
    _jobs: dict[str, TrajectoryJob] = field(default_factory=dict)
    retried: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    _attempts: Counter[str] = field(default_factory=Counter)
    # After a resume: the logged records each step may take back instead of sampling
    # them, and how many it took.
    reusable: dict[int, list[TrajectoryRecord]] = field(default_factory=dict)
    reused: dict[int, int] = field(default_factory=dict)
    dropped: defaultdict[int, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))
    _changed: anyio.Event = field(default_factory=anyio.Event)
    _stream_ended: bool = False

    @property
    def jobs_left(self) -> int:
        """The jobs submitted whose trajectories have not ended yet."""
        return len(self._jobs)

    def submit(self, step: int) -> None:
        """Submit step ``step``'s jobs, but for those whose record the log gave back."""
        jobs = [
            TrajectoryJob(self.env_classes[task.id.env], task, sample, step)
            for task in self.tasks.of_step(step)
            for sample in range(self.config.samples_per_prompt)
        ]
        for job in jobs:
            self._group_ids[str(job.group_id)] = job.group_id
        logged = {r.id: r for r in self.reusable.pop(step, []) if not self._retries(r)}
        taken = [logged[str(job.id)] for job in jobs if str(job.id) in logged]
        submitted = [job for job in jobs if str(job.id) not in logged]
        self._jobs.update((str(job.id), job) for job in submitted)
        self.session.submit(submitted)
        self.reused[step] = len(taken)
        for record in taken:
            self._gather(record)

    async def of_step(self, step: int, tick: Callable[[], None]) -> list[Group]:
        """Step ``step``'s groups, once they are all in (``tick`` for each)."""
        while len(self.groups[step]) < self.config.prompts_per_step:
            if self._stream_ended:
                raise RuntimeError(f"the rollout session ended before step {step}'s groups")
            seen = len(self.groups[step])
            await self._changed.wait()
            for _ in range(len(self.groups[step]) - seen):
                tick()
        return self.groups.pop(step)

    async def read_records(self) -> None:
        """Log each record as its trajectory ends, and sort complete groups by step (one
        reader for the run). Nothing awaits between a record's arrival and its write."""
        async for record in self.session.records():
            if self._runs_again(record):
                continue
            self._jobs.pop(record.id, None)
            self._attempts.pop(record.id, None)
            self.log.append(record)
            self._gather(record)
        self._stream_ended = True
        self._changed.set()

    def _retries(self, record: TrajectoryRecord) -> bool:
        """Whether ``record``'s trajectory runs again rather than counts as it is."""
        return self.config.train.failures == "retry" and record.status == "failed"

    def _runs_again(self, record: TrajectoryRecord) -> bool:
        """Submit a failed trajectory again while it has retries left. The failed run's
        record is not kept: the trajectory's one record is that of its last run."""
        if not self._retries(record) or self._attempts[record.id] >= self.config.train.max_retries:
            return False
        self._attempts[record.id] += 1
        self.retried[record.step] += 1
        self.session.submit([self._jobs[record.id]])
        return True

    def _gather(self, record: TrajectoryRecord) -> None:
        """Add ``record`` to its group; a group whose samples are all in goes to its step."""
        members = self._gathering.setdefault(record.group_id, [])
        members.append(record)
        if len(members) < self.config.samples_per_prompt:
            return
        del self._gathering[record.group_id]
        members.sort(key=lambda member: member.sample)
        group = Group(self._group_ids.pop(record.group_id), tuple(members))
        self.groups[record.step].append(group)
        self._changed.set()
        self._changed = anyio.Event()
