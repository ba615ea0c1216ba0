"""``libra rollout``'s run: one session, its jobs all submitted at once, its records
written as JSONL as each trajectory ends."""

from __future__ import annotations

import signal
from collections import Counter
from collections.abc import Callable, Coroutine
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import anyio
import msgspec

from libra.engine import (
    RolloutSession,
    RolloutStats,
    TrajectoryJob,
    TrajectoryRecord,
    jobs_for,
    jobs_of,
)
from libra.envs import Env
from libra.events import EventBus
from libra.fleet import FleetSpec
from libra.launch._rollout import RolloutConfig, open_engine
from libra.launch._session import load_player, open_session
from libra.launch._tasks import read_tasks
from libra.launch._view import ViewOptions, run_events
from libra.sched import Scheduler
from libra.view import RecordFiles

#: A rollout's progress display: given its counters, a context whose value is called
#: after each record.
Progress = Callable[[RolloutStats], AbstractContextManager[Callable[[], None]]]
#: What watches a rollout while it runs (its timeline, say): the scheduler, the counters.
Watch = Callable[[Scheduler, RolloutStats], Coroutine[Any, Any, None]]


@dataclass
class Failures:
    """The failed records of a run: how many, why, and the first one's error."""

    reasons: Counter[str] = field(default_factory=Counter)
    first_error: str | None = None

    def observe(self, record: TrajectoryRecord) -> None:
        if record.status == "failed":
            self.reasons[record.stop_reason] += 1
            if self.first_error is None:
                self.first_error = record.error

    def too_many(self, done: int, max_fraction: float) -> bool:
        failed = self.reasons.total()
        return done > 0 and (failed == done or failed > max_fraction * done)

    def describe(self, done: int) -> str:
        failed = self.reasons.total()
        which = f"all {done}" if failed == done else f"{failed} of {done}"
        reasons = ", ".join(f"{reason}: {n}" for reason, n in self.reasons.most_common())
        first = f"; the first: {self.first_error}" if self.first_error else ""
        return f"{which} trajectories failed ({reasons}){first}"


@dataclass
class Rollout:
    """A finished rollout: its counters, its failures, the fleet and the scheduler it
    routed with, and its title (env, trajectories, scheduler)."""

    stats: RolloutStats
    failures: Failures
    fleet: FleetSpec
    scheduler: Scheduler
    title: str


async def rollout(
    config: RolloutConfig,
    *,
    view: ViewOptions | None = None,
    progress: Progress | None = None,
    watch: Watch | None = None,
) -> Rollout:
    """Play ``config``'s jobs and write their records to ``config.out``, one a line as
    each ends. Ctrl-C or SIGTERM cancels the rollout, and every trajectory in flight is
    still recorded. With ``view``, the live view is served and the run's events go to
    ``FILE.events.jsonl`` beside the records (``libra view`` shows them again later).
    ``progress`` is told of each record; ``watch`` runs beside the rollout."""
    player = load_player(config)
    env_cls, name = player.env_cls, player.name
    jobs = _jobs(config, env_cls, name)
    encoder = msgspec.json.Encoder()
    failures = Failures()
    warm = min(config.sandbox_pool, config.engine.concurrency, len(jobs))
    bus = EventBus() if view is not None else None
    config.out.parent.mkdir(parents=True, exist_ok=True)
    log = config.out.with_name(config.out.stem + ".events.jsonl")
    async with (
        run_events(bus, log=log, view=view, find_record=RecordFiles(lambda: [config.out]))
        if bus is not None
        else nullcontext(),
        open_engine(config, [env_cls] if env_cls else [], warm, events=bus) as run,
        open_session(run.engine, config, player) as session,
    ):
        stats = session.stats
        session.submit(jobs)
        session.close()
        shown = progress(stats) if progress is not None else nullcontext(lambda: None)
        with config.out.open("wb") as out, shown as tick:
            async with anyio.create_task_group() as group:
                group.start_soon(_stop_on_signal, session)
                if watch is not None:
                    group.start_soon(watch, run.scheduler, stats)
                async for record in session:  # to the end, cancelled ones included
                    out.write(encoder.encode(record) + b"\n")
                    out.flush()
                    failures.observe(record)
                    tick()
                group.cancel_scope.cancel()
    title = f"{name}, {len(jobs)} trajectories, {config.scheduler}"
    return Rollout(stats, failures, run.fleet.spec, run.scheduler, title)


def _jobs(config: RolloutConfig, env_cls: type[Env] | None, env_name: str) -> list[TrajectoryJob]:
    """The tasks of ``config.tasks``, each sampled in turn, or ``n`` of seeded tasks."""
    per_prompt = config.samples_per_prompt
    if config.tasks is None:
        n = config.n or 64
        return jobs_for(env_cls, env_name, n, samples_per_prompt=per_prompt, seed=config.seed)
    jobs = jobs_of(env_cls, read_tasks(config.tasks, env_name), samples_per_prompt=per_prompt)
    return jobs[: config.n]


async def _stop_on_signal(session: RolloutSession) -> None:
    """Ctrl-C or SIGTERM cancels the rollout; every trajectory in flight is still recorded
    (and written: the stream ends after their records)."""
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for _ in signals:
            session.stats.interrupted = True
            session.cancel()
            return
