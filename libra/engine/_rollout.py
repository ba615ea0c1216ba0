"""A rollout: many trajectories at once, under a concurrency limit, cancelled cleanly."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import anyio

from libra.engine._records import TrajectoryRecord
from libra.engine._trajectory import Engine, TrajectoryJob, run_trajectory
from libra.envs import Env


def jobs_for(
    env_cls: type[Env], env_name: str, n: int, *, samples_per_prompt: int = 1, seed: int = 0
) -> list[TrajectoryJob]:
    """``n`` trajectories: ``samples_per_prompt`` samples of each task (GRPO groups)."""
    rng = random.Random(seed)
    prompts = -(-n // samples_per_prompt)
    task_seeds = [rng.randrange(2**31) for _ in range(prompts)]
    return [
        TrajectoryJob(
            env_cls, env_name, task_seeds[i // samples_per_prompt], i % samples_per_prompt
        )
        for i in range(n)
    ]


@dataclass
class RolloutStats:
    """Live counters of a rollout (what a progress bar shows and the summary prints)."""

    total: int = 0
    statuses: Counter[str] = field(default_factory=Counter)
    reward_sum: float = 0.0
    rewarded: int = 0
    turns: int = 0
    tool_calls: int = 0
    tool_successes: int = 0
    with_tool_calls: int = 0  # trajectories that made at least one
    sampled_tokens: int = 0
    started_at: float = 0.0
    elapsed_s: float = 0.0
    interrupted: bool = False

    @property
    def done(self) -> int:
        return sum(self.statuses.values())

    @property
    def reward_mean(self) -> float | None:
        return self.reward_sum / self.rewarded if self.rewarded else None

    @property
    def trajectories_per_s(self) -> float:
        return self.done / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def observe(self, record: TrajectoryRecord) -> None:
        self.statuses[record.status] += 1
        self.turns += record.turns
        self.tool_calls += len(record.tool_returns)
        self.tool_successes += sum(r.status == "success" for r in record.tool_returns)
        self.with_tool_calls += bool(record.tool_returns)
        self.sampled_tokens += sum(record.loss_mask)
        if record.reward is not None:
            self.reward_sum += record.reward
            self.rewarded += 1
        self.elapsed_s = anyio.current_time() - self.started_at


async def rollout(
    jobs: Iterable[TrajectoryJob],
    engine: Engine,
    *,
    on_record: Callable[[TrajectoryRecord], None] | None = None,
    stats: RolloutStats | None = None,
) -> RolloutStats:
    """Run every job, at most ``engine.config.concurrency`` at a time.

    Each finished trajectory's record goes to ``on_record`` (and ``engine.on_record``) as
    soon as it ends, so nothing is lost if the rollout is cancelled: the trajectories
    still running then are recorded as failed with ``stop_reason = "cancelled"``.
    Pass ``stats`` to watch the counters while the rollout runs.
    """
    jobs = list(jobs)
    stats = stats or RolloutStats()
    stats.total, stats.started_at = len(jobs), anyio.current_time()
    sink = engine.on_record

    def record(result: TrajectoryRecord) -> None:
        stats.observe(result)
        if sink is not None:
            sink(result)
        if on_record is not None:
            on_record(result)

    engine.on_record = record
    pending = iter(jobs)

    # ``concurrency`` workers sharing the jobs: a task per job waiting on a limiter cost
    # a fifth of the engine's own CPU (beside HTTP) at 1,000 concurrent trajectories.
    async def worker() -> None:
        for job in pending:
            await run_trajectory(job, engine)

    try:
        async with anyio.create_task_group() as group:
            for _ in range(min(engine.config.concurrency, len(jobs))):
                group.start_soon(worker)
    finally:
        engine.on_record = sink
        stats.elapsed_s = anyio.current_time() - stats.started_at
    return stats
