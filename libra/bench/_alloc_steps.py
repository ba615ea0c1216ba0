"""How one step of ``libra bench alloc`` shares the workers between rollout and training:
colocated (one after the other on all of them), split (side by side), or pooled (side by
side while the hybrid pool lends the rollout's idle tail to training); and the step's
rollout through the real engine and router."""

from __future__ import annotations

from dataclasses import dataclass

import anyio

from libra.alloc import HybridPool, Layout, Plan, PoolConfig, lend_tail
from libra.bench._alloc_settings import Settings
from libra.bench._alloc_strategies import Strategy
from libra.bench._emulated_fleet import MODEL, engine_config
from libra.bench._sched_history import replay_history
from libra.emulation import EmulatedCluster, EmulatedTrainer, EmulatorApp, FleetApp
from libra.emulation.workloads import EnvClasses, ScriptBook
from libra.engine import ASGITransport, Engine, TrajectoryJob, TrajectoryRecord, rollout
from libra.envs import Task
from libra.sched.policies import RoutedPolicy


@dataclass
class StepRun:
    """What one step's rollout and training did, however they shared the workers."""

    records: list[TrajectoryRecord]
    rollout_s: float
    train_s: float
    overhead_s: float
    train_worker_s: float  # workers training, integrated over the training
    serving: list[tuple[int, EmulatorApp]]  # every instance that served, with its TP
    lent: tuple[tuple[tuple[int, ...], str], ...] = ()
    borrows: int = 0
    releases: int = 0


def serving_of(fleet: FleetApp) -> list[tuple[int, EmulatorApp]]:
    return [(tp_of(name), app) for name, app in fleet.apps.items()]


def tp_of(name: str) -> int:
    """``i3-tp2`` or ``w4-5``: the TP of an instance from its name."""
    if "-tp" in name:
        return int(name.rsplit("-tp", 1)[1])
    return len(name[1:].split("-"))


async def colocated_step(
    settings: Settings,
    policy: RoutedPolicy,
    book: ScriptBook,
    step: int,
    trainer: EmulatedTrainer,
    train_tokens: int,
    fleet: FleetApp,
) -> StepRun:
    serving = serving_of(fleet)
    started = anyio.current_time()
    records = await rollout_step(settings, policy, book, step, fleet)
    rollout_s = anyio.current_time() - started
    train_s = await trainer.step(train_tokens)
    workers = len(trainer.active)
    overhead = 2 * settings.serving.reload_s
    return StepRun(records, rollout_s, train_s, overhead, workers * train_s, serving)


async def split_step(
    settings: Settings,
    policy: RoutedPolicy,
    book: ScriptBook,
    step: int,
    trainer: EmulatedTrainer,
    train_tokens: int,
    fleet: FleetApp,
) -> StepRun:
    serving = serving_of(fleet)
    train_s = 0.0

    async def train() -> None:
        nonlocal train_s
        train_s = await trainer.step(train_tokens)

    started = anyio.current_time()
    async with anyio.create_task_group() as group:
        group.start_soon(train)
        records = await rollout_step(settings, policy, book, step, fleet)
        rollout_s = anyio.current_time() - started
    overhead = settings.serving.sync_s(settings.fleet.model)
    workers = len(trainer.active)
    return StepRun(records, rollout_s, train_s, overhead, workers * train_s, serving)


async def pooled_step(
    settings: Settings,
    strategy: Strategy,
    plan: Plan,
    book: ScriptBook,
    step: int,
    trainer: EmulatedTrainer,
    train_tokens: int,
    policy: RoutedPolicy,
    cluster: EmulatedCluster,
    layout: Layout,
    expected_train_s: float,
) -> StepRun:
    """Rollout and training side by side while the hybrid pool lends the rollout's idle
    tail to training (:func:`~libra.alloc.lend_tail`) and brings back, at the start, the
    units lent at the end of the last step."""
    assert strategy.tail is not None
    serving: dict[int, tuple[int, EmulatorApp]] = {
        id(app): (tp_of(name), app) for name, app in cluster.fleet.apps.items()
    }
    jobs = len(book.step(step))
    records: list[TrajectoryRecord] = []
    training_done = anyio.Event()
    train_s = rollout_s = 0.0
    pool_config = pool_config_of(settings)
    started = anyio.current_time()

    async def train() -> None:
        nonlocal train_s
        train_s = await trainer.step(train_tokens)
        training_done.set()

    async with HybridPool(cluster, policy.router, layout, pool_config) as pool:
        if layout.lent:
            pool.release(len(layout.lent))  # the rollout needs them back: restart them
        async with anyio.create_task_group() as group:
            group.start_soon(train)
            group.start_soon(
                lend_tail,
                pool,
                strategy.tail,
                lambda: jobs - len(records),
                lambda: expected_train_s - (anyio.current_time() - started),
                training_done,
            )
            await rollout_step(settings, policy, book, step, cluster.fleet, records)
            rollout_s = anyio.current_time() - started
            for name, app in cluster.fleet.apps.items():  # restarted ones served too
                serving.setdefault(id(app), (tp_of(name), app))
    ended = anyio.current_time() - started
    overhead = settings.serving.sync_s(settings.fleet.model)
    # Moves still under way when both halves are done hold the next step back.
    overhead += max(0.0, ended - max(rollout_s, train_s))
    spans = pool.spans(started + train_s)
    worker_s = sum(
        min(end, started + train_s) - max(begin, started)
        for _, state, begin, end in spans
        if state == "active" and end > started and begin < started + train_s
    )
    lent = tuple(
        (unit.workers, unit.bucket)
        for unit in pool.units
        if unit.role == "hybrid" and unit.stage == "training" and not pool.lost(unit)
    )
    moves = [move for move in pool.moves if move.outcome == "done"]
    return StepRun(
        records,
        rollout_s,
        train_s,
        overhead,
        worker_s,
        list(serving.values()),
        lent,
        sum(1 for move in moves if move.direction == "borrow"),
        sum(1 for move in moves if move.direction == "release"),
    )


def pool_config_of(settings: Settings) -> PoolConfig:
    fleet = settings.fleet
    return PoolConfig(
        model=MODEL,
        api="tokens",
        max_num_seqs=fleet.serving.max_num_seqs,
        kv_capacity_tokens=fleet.roofline.kv_capacity_tokens(1),
        drain_timeout_s=60.0,
    )


async def rollout_step(
    settings: Settings,
    policy: RoutedPolicy,
    book: ScriptBook,
    step: int,
    fleet: FleetApp,
    records: list[TrajectoryRecord] | None = None,
) -> list[TrajectoryRecord]:
    workload = settings.workload
    replay_history(policy, book, step)
    scripts = book.step(step)
    env_classes = EnvClasses(book)
    jobs = [
        TrajectoryJob(env_classes(step, s.sample), Task(s.task_id, s.task_seed), s.sample, step)
        for s in scripts
    ]
    records = [] if records is None else records
    async with ASGITransport(fleet) as http:
        engine = Engine(http, policy, config=engine_config(workload, len(jobs), settings.seed))
        await rollout(jobs, engine, on_record=records.append)
    return records
