"""A one-shot rollout (a session run to its end), and the jobs of seeded or listed tasks."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable

from libra.engine._engine import Engine
from libra.engine._job import TrajectoryJob
from libra.engine._records import TrajectoryRecord
from libra.engine._session import RolloutSession
from libra.engine._stats import RolloutStats
from libra.envs import Env, Task


def jobs_for(
    env_cls: type[Env] | None,
    env_name: str,
    n: int,
    *,
    samples_per_prompt: int = 1,
    seed: int = 0,
    step: int = 0,
) -> list[TrajectoryJob]:
    """``n`` trajectories of seeded tasks at RL step ``step``: ``samples_per_prompt``
    samples of each task (GRPO groups); ``seed`` draws the tasks' seeds."""
    rng = random.Random(seed)
    prompts = -(-n // samples_per_prompt)
    tasks = [Task.from_seed(env_name, rng.randrange(2**31)) for _ in range(prompts)]
    return [
        TrajectoryJob(env_cls, tasks[i // samples_per_prompt], i % samples_per_prompt, step)
        for i in range(n)
    ]


def jobs_of(
    env_cls: type[Env] | None, tasks: Iterable[Task], *, samples_per_prompt: int = 1, step: int = 0
) -> list[TrajectoryJob]:
    """``samples_per_prompt`` trajectories of each of ``tasks`` at RL step ``step``."""
    return [
        TrajectoryJob(env_cls, task, sample, step)
        for task in tasks
        for sample in range(samples_per_prompt)
    ]


async def rollout(
    jobs: Iterable[TrajectoryJob],
    engine: Engine,
    *,
    on_record: Callable[[TrajectoryRecord], None] | None = None,
    stats: RolloutStats | None = None,
) -> RolloutStats:
    """Run every job in a session of its own (at most ``engine.config.concurrency`` at
    a time) and hand each record to ``on_record`` as its trajectory ends.

    If the rollout is cancelled, the trajectories running then are recorded as failed
    with ``stop_reason = "cancelled"`` and still reach ``on_record``; jobs never started
    leave no record. Pass ``stats`` to watch the counters while the rollout runs.
    """
    session = RolloutSession(engine, stats=stats)
    try:
        async with session:
            session.submit(jobs)
            session.close()
            async for record in session.records():
                if on_record is not None:
                    on_record(record)
    finally:
        if on_record is not None:
            for record in session.unread():  # those recorded while cancelled
                on_record(record)
    return session.stats
