"""``libra bench alloc --ahead``: what running rollouts steps ahead of training buys.

The same workers split the same way (the up-front split: half train, half serve at TP1),
the same workload, the same emulated trainer, in virtual time; only how far ahead of
training the rollouts run differs, as in ``libra train``'s loop (``libra/train/_loop.py``):
steps ``0..K-1`` are submitted at the start; once step k's records are all in, step
``k + K`` is submitted and step k trains on its own records; then the weights sync (every
server paused, its running batch kept, for the broadcast; each endpoint's weight version
bumped). ``K = 1`` is ``one-step-off``, ``K >= 2`` is ``async`` with ``max_ahead = K``.

The trainer is idle while it waits for a step's last trajectory (the long tail of an
agentic rollout) and during the sync. With ``K >= 2`` the next steps' trajectories keep
the servers busy through that tail, at the price of staler samples: each trained token's
versions behind is what ``grpo.max_staleness`` would then have to allow.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

import anyio
from rich.console import Console
from rich.table import Table

from libra.bench._alloc_fleet import fleet_apps, fleet_spec, serving_units
from libra.bench._alloc_settings import Settings
from libra.bench._alloc_strategies import UPFRONT_SHARE, static_plan
from libra.bench._emulated_fleet import engine_config, in_virtual_time
from libra.bench._sched_history import replay_history
from libra.emulation import EmulatedTrainer, EmulatorApp, FleetApp
from libra.emulation.workloads import EnvClasses, ScriptBook
from libra.engine import ASGITransport, Engine, RolloutSession, TrajectoryJob, TrajectoryRecord
from libra.envs import Task
from libra.sched.policies import RoutedPolicy, make_policy

__all__ = ["AheadRun", "print_table", "run_ahead", "summary"]

POLICY = "least-loaded"  # the static split's, as in ``libra bench alloc``


@dataclass(frozen=True)
class AheadRun:
    """Every step of one ``K``: where the seconds went."""

    ahead: int
    steps: int
    seconds: float  # from the first submit to the last step's sync
    train_s: float  # the trainer training, summed over the steps
    sync_s: float
    tokens: int  # trained
    serving_busy_s: float  # worker-seconds the servers spent generating
    serving_workers: int
    behind: list[int]  # per trained token: versions between its sampler and the trainer

    @property
    def mode(self) -> str:
        return "one-step-off" if self.ahead == 1 else f"async, max_ahead {self.ahead}"

    @property
    def trainer_idle_frac(self) -> float:
        return 1.0 - self.train_s / self.seconds

    @property
    def serving_idle_frac(self) -> float:
        return 1.0 - self.serving_busy_s / (self.serving_workers * self.seconds)

    @property
    def throughput_tok_s(self) -> float:
        return self.tokens / self.seconds

    def as_json(self) -> dict[str, object]:
        return {
            "mode": self.mode,
            "ahead": self.ahead,
            "step_time_s": round(self.seconds / self.steps, 2),
            "trainer_idle_frac": round(self.trainer_idle_frac, 4),
            "serving_idle_frac": round(self.serving_idle_frac, 4),
            "throughput_tok_s": round(self.throughput_tok_s, 1),
            "behind_mean": round(statistics.fmean(self.behind), 3) if self.behind else 0.0,
            "behind_max": max(self.behind, default=0),
        }


def run_ahead(settings: Settings, ahead: int) -> AheadRun:
    """``settings.steps`` steps with rollouts ``ahead`` steps ahead, in virtual time;
    deterministic for a seed."""
    if ahead < 1:
        raise ValueError(f"rollouts run 1 or more steps ahead, not {ahead}")
    return in_virtual_time(_run, settings, ahead, seed=settings.seed)


async def _run(settings: Settings, ahead: int) -> AheadRun:
    book = ScriptBook(settings.workload, settings.seed)
    first = settings.workload.rollout.history_steps
    steps = range(first, first + settings.steps)
    plan = static_plan(settings.gpus, UPFRONT_SHARE)
    units = serving_units(plan)
    names = [f"i{index}-tp{len(unit)}" for index, unit in enumerate(units)]
    apps, _ = fleet_apps(settings, plan, book, first, names)
    policy = make_policy(POLICY, fleet_spec(settings, plan, apps))
    replay_history(policy, book, first)
    trainer = EmulatedTrainer(
        settings.fleet.gpu, settings.fleet.model, settings.training, seed=settings.seed
    )
    trainer.active = set(range(plan.train_workers))
    jobs = len(book.step(first))
    config = engine_config(settings.workload, jobs * ahead, settings.seed)
    by_step: dict[int, list[TrajectoryRecord]] = defaultdict(list)
    train_s = sync_s = 0.0
    behind: list[int] = []
    started = anyio.current_time()
    async with ASGITransport(FleetApp(apps)) as http:
        engine = Engine(http, policy, config=config)
        async with RolloutSession(engine) as session, anyio.create_task_group() as group:
            steps_in = {step: anyio.Event() for step in steps}

            async def read() -> None:
                async for record in session.records():
                    by_step[record.step].append(record)
                    if len(by_step[record.step]) == len(book.step(record.step)):
                        steps_in[record.step].set()

            group.start_soon(read)
            for step in steps[:ahead]:
                session.submit(_jobs(book, step))
            for version, step in enumerate(steps):
                await steps_in[step].wait()
                if step + ahead in steps:
                    session.submit(_jobs(book, step + ahead))
                records = by_step.pop(step)
                tokens = sum(len(record.token_ids) for record in records)
                train_s += await trainer.step(tokens)
                behind += [version - (r.weight_version or 0) for r in records for _ in r.token_ids]
                sync_s += await _sync(settings, policy, apps.values(), version + 1)
            session.close()
    seconds = anyio.current_time() - started
    tokens = len(behind)
    busy = sum(app.engine.busy_s for app in apps.values() if app.engine is not None)
    return AheadRun(ahead, len(steps), seconds, train_s, sync_s, tokens, busy, len(apps), behind)


def _jobs(book: ScriptBook, step: int) -> list[TrajectoryJob]:
    env_classes = EnvClasses(book)
    return [
        TrajectoryJob(env_classes(step, s.sample), Task(s.task_id, s.task_seed), s.sample, step)
        for s in book.step(step)
    ]


async def _sync(
    settings: Settings, policy: RoutedPolicy, apps: Iterable[EmulatorApp], version: int
) -> float:
    """The weights of ``version`` into every server: each pauses keeping its running
    batch (``WeightSyncConfig.pause_mode``'s default) for the broadcast, then resumes."""
    engines = [app.engine for app in apps if app.engine is not None]
    seconds = settings.serving.sync_s(settings.fleet.model)
    for engine in engines:
        engine.pause("keep")
    await anyio.sleep(seconds)
    for endpoint in policy.router.endpoints().values():
        endpoint.weight_version = version
    for engine in engines:
        engine.resume()
    return seconds


def summary(runs: list[AheadRun]) -> dict[str, object]:
    """The JSON report: per ``K``, and what each ``async`` run buys over one-step-off."""
    base = next((run for run in runs if run.ahead == 1), None)
    return {
        "results": [run.as_json() for run in runs],
        "vs_one_step_off": {
            str(run.ahead): {
                "trainer_idle": round(run.trainer_idle_frac / base.trainer_idle_frac, 3),
                "throughput": round(run.throughput_tok_s / base.throughput_tok_s, 3),
            }
            for run in runs
            if base is not None and run is not base
        },
    }


def print_table(settings: Settings, runs: list[AheadRun]) -> None:
    table = Table(
        title=f"libra bench alloc --ahead: {settings.workload.name}, {settings.gpus} x "
        f"{settings.fleet.gpu.name} {settings.fleet.model.name} split up front, "
        f"{settings.steps} steps, seed {settings.seed}"
    )
    header = ("mode", "step s", "trainer idle", "serving idle", "tok/s", "behind mean/max")
    for column in header:
        table.add_column(column, justify="right")
    for run in runs:
        line = run.as_json()
        table.add_row(
            run.mode, f"{line['step_time_s']:.1f}", f"{run.trainer_idle_frac:.1%}",
            f"{run.serving_idle_frac:.1%}", f"{run.throughput_tok_s:,.0f}",
            f"{line['behind_mean']:.2f} / {line['behind_max']}",
        )  # fmt: skip
    Console().print(table)
