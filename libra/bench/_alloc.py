"""``libra bench alloc``: worker splits graded on an emulated multi-step RL run.

For each configuration (:mod:`libra.bench._alloc_strategies`), K steps of one-step-off RL
run on N emulated workers, in virtual time (trio's ``MockClock``): step k's rollout goes
through the real engine and router (C-MLFQ or least-loaded) to an in-process fleet of
emulated vLLM servers laid out per the plan in force (one instance per entry of its
``rollout_tps``, buckets by its ceilings), while an :class:`~libra.emulation.EmulatedTrainer`
trains step k-1's batch on the plan's training workers. The step takes the longer of the
two plus the weight broadcast; a re-layout adds what starting servers and joining the
trainer cost. Colocated (verl-style) rolls out on all N workers, then trains on all N,
and pays a switch (weights off and back on) each way.

The emulated truth (:class:`~libra.emulation.ServingTruth`,
:class:`~libra.emulation.TrainTruth`) is not the planner's model: achieved bandwidth and
MFU, TP efficiency, an all-reduce growing with the batch, prefill slowing decode, jitter,
trainer collectives. The planner sees only what a real run would report: each call's
tokens and seconds and each step's timing.

Full Libra also runs the hybrid pool inside each step: an :class:`EmulatedCluster` holds
the step's instances and trainer, :func:`~libra.alloc.lend_tail` borrows hybrid units
into the training under way when the rollout's tail leaves them idle, and the next step
releases them as its rollout starts (their servers restart while it runs); every move
pays what the truth says (drain, stop, state fetch, zero-sync, activate, restart).
"""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace

import anyio
from trio.testing import MockClock

from libra.alloc import (
    CallTiming,
    HybridPool,
    Layout,
    Plan,
    PoolConfig,
    StepTiming,
    TailRule,
    instance_name,
    lend_tail,
)
from libra.alloc import Workload as Demand
from libra.bench._alloc_strategies import Strategy, strategies
from libra.bench._sched import (
    MODEL,
    FleetApp,
    _engine_config,
    _seed_trio_scheduler,
    replay_history,
)
from libra.bench._sched_fleet import FleetFile
from libra.emulation import (
    BatchingEngine,
    ClusterTruth,
    EmulatedCluster,
    EmulatedTrainer,
    EmulatorApp,
    EmulatorConfig,
    ServingTruth,
    TrainTruth,
    create_app,
)
from libra.emulation.workloads import (
    EnvClasses,
    ScriptBook,
    TrajectoryScript,
    Workload,
    WorkloadScript,
)
from libra.engine import ASGITransport, Engine, TrajectoryJob, TrajectoryRecord, rollout
from libra.envs import Task
from libra.fleet import BucketSpec, FleetSpec, InstanceSpec
from libra.sched.policies import RoutedPolicy, make_policy

_CONTEXT_MARGIN = 8192  # template tokens beyond the workload's own context limit


@dataclass(frozen=True)
class Settings:
    workload: Workload
    fleet: FleetFile
    gpus: int
    steps: int
    seed: int = 0
    serving: ServingTruth = field(default_factory=ServingTruth)
    training: TrainTruth = field(default_factory=TrainTruth)
    #: Full Libra's in-step rule: when the rollout's tail lends hybrid units to training.
    tail: TailRule = field(default_factory=TailRule)


@dataclass(frozen=True)
class StepResult:
    step: int
    train_workers: int
    rollout_tps: tuple[int, ...]
    rollout_s: float
    train_s: float
    overhead_s: float  # weight sync, switches and moves
    train_tokens: int
    busy_worker_s: float
    colocated: bool = False  # rollout then training on the same workers
    #: Hybrid units on the training side when the step ended (pool configs only): the
    #: next step releases them (their instances restart while its rollout runs).
    lent: tuple[tuple[tuple[int, ...], str], ...] = ()
    #: Mean workers training over the step's training (more than planned when the pool lent).
    mean_train_workers: float = 0.0
    borrows: int = 0  # units borrowed inside the step
    releases: int = 0  # units released inside the step
    records: int = 0  # trajectories recorded
    serving_busy_s: float = 0.0  # worker-seconds the instances spent generating

    @property
    def rollout_idle_frac(self) -> float:
        """The serving workers' share of the rollout spent with nothing to generate
        (mostly the long tail: a few trajectories decoding, or waiting on their tools)."""
        capacity = sum(self.rollout_tps) * self.rollout_s
        return 1.0 - self.serving_busy_s / capacity if capacity else 0.0

    @property
    def step_s(self) -> float:
        if self.colocated:
            return self.rollout_s + self.train_s + self.overhead_s
        return max(self.rollout_s, self.train_s) + self.overhead_s


@dataclass
class ConfigRun:
    config: str
    gpus: int
    steps: list[StepResult]
    plan_errors: list[float]  # per step: predicted / measured step - 1 (planners only)
    #: per step: the same, predicted after the fact for the workload the step turned out
    #: to be, before its own observations are fitted (the cost model's error alone).
    model_errors: list[float] = field(default_factory=list)

    @property
    def seconds(self) -> float:
        return sum(step.step_s for step in self.steps)

    @property
    def step_time_s(self) -> float:
        return self.seconds / len(self.steps)

    @property
    def throughput_tok_s(self) -> float:
        return sum(step.train_tokens for step in self.steps) / self.seconds

    @property
    def idle_frac(self) -> float:
        busy = sum(step.busy_worker_s for step in self.steps)
        return 1.0 - busy / (self.gpus * self.seconds)

    @property
    def rollout_idle_frac(self) -> float:
        capacity = sum(sum(step.rollout_tps) * step.rollout_s for step in self.steps)
        busy = sum(step.serving_busy_s for step in self.steps)
        return 1.0 - busy / capacity if capacity else 0.0


# ------------------------------------------------------------------------ one config


def run_config(settings: Settings, name: str) -> ConfigRun:
    """Every step of configuration ``name``, in virtual time; deterministic for a seed."""
    _seed_trio_scheduler(settings.seed)
    result: ConfigRun = anyio.run(
        _run_config,
        settings,
        name,
        backend="trio",
        backend_options={"clock": MockClock(autojump_threshold=0)},
    )
    return result


def config_names(settings: Settings) -> list[str]:
    fleet = settings.fleet
    return [s.name for s in strategies(fleet.gpu, fleet.model, settings.gpus, settings.tail)]


async def _run_config(settings: Settings, name: str) -> ConfigRun:
    fleet = settings.fleet
    every = strategies(fleet.gpu, fleet.model, settings.gpus, settings.tail)
    strategy = next(s for s in every if s.name == name)
    book = ScriptBook(settings.workload, settings.seed)
    first = settings.workload.rollout.history_steps
    history = [script for k in range(max(0, first - 2), first) for script in book.step(k)]
    demand = demand_of_scripts(history)
    plan = strategy.first_plan(settings.gpus, demand)
    trainer = EmulatedTrainer(fleet.gpu, fleet.model, settings.training, seed=settings.seed)
    pending_tokens = sum(_script_tokens(script) for script in book.step(first - 1))
    recent: list[list[TrajectoryRecord]] = []
    steps: list[StepResult] = []
    errors: list[float] = []
    model_errors: list[float] = []
    move_s = 0.0
    lent: tuple[tuple[tuple[int, ...], str], ...] = ()
    for step in range(first, first + settings.steps):
        strategy.predict(step, plan, demand)
        # What training should take, from what the run measured (the planner's fit).
        expected_train_s = strategy.expected_train_s(plan, pending_tokens)
        result, records = await _one_step(
            settings, strategy, plan, book, step, pending_tokens, lent, expected_train_s
        )
        result = _with_overhead(result, move_s)
        steps.append(result)
        pending_tokens = result.train_tokens
        hindsight = strategy.hindsight(plan, demand_of_records([records]))
        if hindsight is not None:
            model_errors.append(hindsight / max(result.rollout_s, result.train_s) - 1)
        recent = [*recent[-1:], records]
        demand = demand_of_records(recent)
        timing = StepTiming(
            step,
            result.rollout_s,
            result.train_s,
            result.train_tokens,
            # What trained, on average: the pool's lent workers took a share of the step.
            max(plan.train_workers, round(result.mean_train_workers)),
            plan.rollout_workers,
        )
        strategy.observe_step(timing, demand)
        errors += [entry["error"]["step_s"] for entry in strategy.log.entries[len(errors) :]]
        new = strategy.next_plan(step, plan, demand)
        move_s = _move_seconds(settings, trainer, plan, new)
        lent = result.lent if new == plan else ()  # a new layout restarts every instance
        plan = new
    return ConfigRun(name, settings.gpus, steps, errors, model_errors)


def _with_overhead(result: StepResult, extra_s: float) -> StepResult:
    if not extra_s:
        return result
    return replace(result, overhead_s=result.overhead_s + extra_s)


def _move_seconds(settings: Settings, trainer: EmulatedTrainer, old: Plan, new: Plan) -> float:
    """Servers restart in parallel; joiners fetch the training state meanwhile."""
    if new == old:
        return 0.0
    restart = settings.serving.start_s if sorted(new.rollout_tps) != sorted(old.rollout_tps) else 0
    truth = trainer.truth
    fetch = trainer.model.parameters * truth.state_bytes_per_param / truth.link_bytes_per_s
    join = (
        fetch + truth.zero_sync_s + truth.activate_s if new.train_workers > old.train_workers else 0
    )
    return max(restart, join)


async def _one_step(
    settings: Settings,
    strategy: Strategy,
    plan: Plan,
    book: ScriptBook,
    step: int,
    train_tokens: int,
    lent: tuple[tuple[tuple[int, ...], str], ...] = (),
    expected_train_s: float = 0.0,
) -> tuple[StepResult, list[TrajectoryRecord]]:
    trainer = EmulatedTrainer(
        settings.fleet.gpu,
        settings.fleet.model,
        settings.training,
        seed=settings.seed * 7919 + step,
    )
    trainer.active = set(range(plan.train_workers))
    pooled = strategy.tail is not None
    units = _serving_units(plan)
    # The pool names an instance by its workers (it moves them); the rest by position.
    names = [
        instance_name(unit) if pooled else f"i{index}-tp{len(unit)}"
        for index, unit in enumerate(units)
    ]
    apps, calls = _fleet_apps(settings, plan, book, step, names)
    policy = make_policy(strategy.policy, _fleet_spec(settings, plan, apps))
    fleet = FleetApp(apps)
    lent_units = {unit for unit, _ in lent}
    for name, unit in zip(names, units, strict=True):
        if unit in lent_units:  # it comes back during this step: not serving yet
            policy.router.remove(name)
            fleet.remove(name)
    if pooled:
        cluster = _cluster(settings, book, step, trainer, fleet, units, names)
        run = await _pooled_step(
            settings,
            strategy,
            plan,
            book,
            step,
            trainer,
            train_tokens,
            policy,
            cluster,
            _layout(plan, units, lent),
            expected_train_s,
        )
    elif strategy.colocated:
        run = await _colocated_step(settings, policy, book, step, trainer, train_tokens, fleet)
    else:
        run = await _split_step(settings, policy, book, step, trainer, train_tokens, fleet)
    for call in calls:
        strategy.observe_call(call)
    serving_busy = sum(tp * app.engine.busy_s for tp, app in run.serving if app.engine is not None)
    result = StepResult(
        step,
        plan.train_workers,
        plan.rollout_tps,
        run.rollout_s,
        run.train_s,
        run.overhead_s,
        sum(len(record.token_ids) for record in run.records),
        serving_busy + run.train_worker_s,
        strategy.colocated,
        run.lent,
        run.train_worker_s / run.train_s if run.train_s else 0.0,
        run.borrows,
        run.releases,
        len(run.records),
        serving_busy,
    )
    return result, run.records


@dataclass
class _StepRun:
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


def _serving(fleet: FleetApp) -> list[tuple[int, EmulatorApp]]:
    return [(_tp_of(name), app) for name, app in fleet.apps.items()]


def _tp_of(name: str) -> int:
    """``i3-tp2`` or ``w4-5``: the TP of an instance from its name."""
    if "-tp" in name:
        return int(name.rsplit("-tp", 1)[1])
    return len(name[1:].split("-"))


async def _colocated_step(
    settings: Settings,
    policy: RoutedPolicy,
    book: ScriptBook,
    step: int,
    trainer: EmulatedTrainer,
    train_tokens: int,
    fleet: FleetApp,
) -> _StepRun:
    serving = _serving(fleet)
    started = anyio.current_time()
    records = await _rollout(settings, policy, book, step, fleet)
    rollout_s = anyio.current_time() - started
    train_s = await trainer.step(train_tokens)
    workers = len(trainer.active)
    overhead = 2 * settings.serving.reload_s
    return _StepRun(records, rollout_s, train_s, overhead, workers * train_s, serving)


async def _split_step(
    settings: Settings,
    policy: RoutedPolicy,
    book: ScriptBook,
    step: int,
    trainer: EmulatedTrainer,
    train_tokens: int,
    fleet: FleetApp,
) -> _StepRun:
    serving = _serving(fleet)
    train_s = 0.0

    async def train() -> None:
        nonlocal train_s
        train_s = await trainer.step(train_tokens)

    started = anyio.current_time()
    async with anyio.create_task_group() as group:
        group.start_soon(train)
        records = await _rollout(settings, policy, book, step, fleet)
        rollout_s = anyio.current_time() - started
    overhead = settings.serving.sync_s(settings.fleet.model)
    workers = len(trainer.active)
    return _StepRun(records, rollout_s, train_s, overhead, workers * train_s, serving)


async def _pooled_step(
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
) -> _StepRun:
    """Rollout and training side by side while the hybrid pool lends the rollout's idle
    tail to training (:func:`~libra.alloc.lend_tail`) and brings back, at the start, the
    units lent at the end of the last step."""
    assert strategy.tail is not None
    serving: dict[int, tuple[int, EmulatorApp]] = {
        id(app): (_tp_of(name), app) for name, app in cluster.fleet.apps.items()
    }
    jobs = len(book.step(step))
    records: list[TrajectoryRecord] = []
    training_done = anyio.Event()
    train_s = rollout_s = 0.0
    pool_config = _pool_config(settings)
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
            await _rollout(settings, policy, book, step, cluster.fleet, records)
            rollout_s = anyio.current_time() - started
            for name, app in cluster.fleet.apps.items():  # restarted ones served too
                serving.setdefault(id(app), (_tp_of(name), app))
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
    return _StepRun(
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


def _serving_units(plan: Plan) -> list[tuple[int, ...]]:
    """The workers of each instance of ``plan``: training takes the first ones."""
    units: list[tuple[int, ...]] = []
    first = plan.train_workers
    for tp in plan.rollout_tps:
        units.append(tuple(range(first, first + tp)))
        first += tp
    return units


def _layout(
    plan: Plan,
    units: list[tuple[int, ...]],
    lent: tuple[tuple[tuple[int, ...], str], ...],
) -> Layout:
    """The first (largest) instance is core rollout; every other one is hybrid."""
    away = {unit for unit, _ in lent}
    return Layout(
        training=tuple(range(plan.train_workers)),
        rollout=tuple(units[:1]),
        hybrid=tuple(unit for unit in units[1:] if unit not in away),
        lent=lent,
    )


def _pool_config(settings: Settings) -> PoolConfig:
    fleet = settings.fleet
    return PoolConfig(
        model=MODEL,
        api="tokens",
        max_num_seqs=fleet.serving.max_num_seqs,
        kv_capacity_tokens=fleet.roofline.kv_capacity_tokens(1),
        drain_timeout_s=60.0,
    )


def _cluster(
    settings: Settings,
    book: ScriptBook,
    step: int,
    trainer: EmulatedTrainer,
    fleet: FleetApp,
    units: list[tuple[int, ...]],
    names: list[str],
) -> EmulatedCluster:
    """The step's workers: the plan's instances serving in ``fleet`` (already started),
    the trainer; a restart costs what starting a server really does."""
    model = settings.fleet
    cluster = EmulatedCluster(
        settings.gpus,
        trainer,
        lambda tp: settings.serving.latency(model.gpu, model.model, tp, model.serving.max_num_seqs),
        server=_server_config(settings, step, len(units)),
        script=WorkloadScript(book),
        truth=ClusterTruth(start_s=settings.serving.start_s),
    )
    cluster.fleet = fleet
    for name, unit in zip(names, units, strict=True):
        if name in fleet.apps:
            cluster.placement[name] = unit
    return cluster


async def _rollout(
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
        engine = Engine(http, policy, config=_engine_config(workload, len(jobs), settings.seed))
        await rollout(jobs, engine, on_record=records.append)
    return records


def _fleet_spec(settings: Settings, plan: Plan, apps: dict[str, EmulatorApp]) -> FleetSpec:
    """The scheduler's view: the datasheet cost (not the truth), buckets by the plan."""
    roofline = settings.fleet.roofline
    names = list(apps)
    instances = [
        InstanceSpec(
            name=name,
            url=f"http://{name}",
            model=MODEL,
            api="tokens",
            tp=tp,
            max_num_seqs=settings.fleet.serving.max_num_seqs,
            kv_capacity_tokens=roofline.kv_capacity_tokens(tp),
            cost=roofline.step_cost(tp),
        )
        for name, tp in zip(names, plan.rollout_tps, strict=True)
    ]
    sizes = sorted(set(plan.rollout_tps))
    ceilings = list(plan.bucket_ceilings) if len(plan.bucket_ceilings) == len(sizes) else []
    if not ceilings:
        sizes, ceilings = [0], [settings.workload.limits.max_context_tokens]
    buckets = [
        BucketSpec(
            name=f"b{index}",
            max_tokens=max(1, ceiling),
            instances=[n for n, tp in zip(names, plan.rollout_tps, strict=True) if size in (0, tp)],
        )
        for index, (size, ceiling) in enumerate(zip(sizes, ceilings, strict=True))
    ]
    return FleetSpec(
        instances=instances,
        buckets=buckets,
        max_queue_length=settings.fleet.serving.max_queue_length,
    )


def _fleet_apps(
    settings: Settings, plan: Plan, book: ScriptBook, step: int, names: list[str]
) -> tuple[dict[str, EmulatorApp], list[CallTiming]]:
    """One emulated server per instance of the plan (named ``names``), playing the
    truth, with a tap that reports each call as vLLM's per-request metrics would."""
    script = WorkloadScript(book)
    fleet = settings.fleet
    apps: dict[str, EmulatorApp] = {}
    calls: list[CallTiming] = []
    for index, (name, tp) in enumerate(zip(names, plan.rollout_tps, strict=True)):
        latency = settings.serving.latency(fleet.gpu, fleet.model, tp, fleet.serving.max_num_seqs)
        config = _server_config(settings, step, index).model_copy(update={"latency": latency})
        app = apps[name] = create_app(config, script)
        assert app.engine is not None  # the truth's latency is never zero
        _tap(app.engine, name, tp, calls)
    return apps, calls


def _server_config(settings: Settings, step: int, index: int) -> EmulatorConfig:
    """The settings of the step's ``index``-th server (its latency is the caller's)."""
    fleet, workload = settings.fleet, settings.workload
    return EmulatorConfig(
        model_name=MODEL,
        prefix_caching=fleet.serving.prefix_caching,
        max_model_len=workload.limits.max_context_tokens + 2 * _CONTEXT_MARGIN,
        seed=settings.seed * 100_003 + step * 101 + index,
    )


def _tap(engine: BatchingEngine, name: str, tp: int, calls: list[CallTiming]) -> None:
    generate = engine.generate

    async def timed(
        prompt_tokens: int, new_tokens: int, *, priority: int = 0, cached_tokens: int = 0
    ) -> int:
        concurrent = engine.num_running + engine.num_waiting + 1
        sent = anyio.current_time()
        produced = await generate(
            prompt_tokens, new_tokens, priority=priority, cached_tokens=cached_tokens
        )
        seconds = anyio.current_time() - sent
        calls.append(
            CallTiming(name, tp, prompt_tokens, cached_tokens, produced, seconds, concurrent)
        )
        return produced

    setattr(engine, "generate", timed)  # noqa: B010 (a per-instance tap on a bound method)


# ----------------------------------------------------------------------- the demand


def demand_of_records(steps: list[list[TrajectoryRecord]]) -> Demand:
    """What the next step will ask, from the recent steps' records pooled."""
    records = [record for records in steps for record in records]
    return Demand(
        trajectories=len(steps[-1]),
        output_tokens=tuple(sum(record.loss_mask) for record in records),
        context_tokens=tuple(len(record.token_ids) for record in records),
        turns=tuple(record.turns for record in records),
        tool_s=tuple(record.timings.tool_s for record in records),
    )


def demand_of_scripts(scripts: list[TrajectoryScript]) -> Demand:
    """The same, from the earlier steps' scripts (what a run saw before this one)."""
    per_step = len(scripts) // max(1, len({s.step for s in scripts}))
    return Demand(
        trajectories=per_step,
        output_tokens=tuple(sum(turn.output_tokens for turn in s.turns) for s in scripts),
        context_tokens=tuple(_script_tokens(s) for s in scripts),
        turns=tuple(len(s.turns) for s in scripts),
        tool_s=tuple(s.tool_s for s in scripts),
    )


def _script_tokens(script: TrajectoryScript) -> int:
    """Prompt, outputs and tool returns (the byte tokenizer: a character is a token)."""
    return script.prompt_tokens + sum(t.output_tokens + t.output_chars for t in script.turns)


# ------------------------------------------------------------------------ all of them


def run_alloc_bench(settings: Settings, names: list[str], jobs: int = 1) -> list[ConfigRun]:
    """Every configuration; ``jobs`` > 1 runs them in parallel processes (the same
    numbers: each run is deterministic on its own)."""
    if jobs > 1 and len(names) > 1:
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(min(jobs, len(names)), mp_context=context) as pool:
            futures = [pool.submit(run_config, settings, name) for name in names]
            return [future.result() for future in futures]
    return [run_config(settings, name) for name in names]
