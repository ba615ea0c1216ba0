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
"""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

import anyio
from trio.testing import MockClock

from libra.alloc import CallTiming, Plan, StepTiming
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
from libra.sched.policies import make_policy

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
    return [s.name for s in strategies(fleet.gpu, fleet.model, settings.gpus)]


async def _run_config(settings: Settings, name: str) -> ConfigRun:
    fleet = settings.fleet
    strategy = next(s for s in strategies(fleet.gpu, fleet.model, settings.gpus) if s.name == name)
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
    for step in range(first, first + settings.steps):
        strategy.predict(step, plan, demand)
        result, records = await _one_step(settings, strategy, plan, book, step, pending_tokens)
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
            plan.train_workers,
            plan.rollout_workers,
        )
        strategy.observe_step(timing, demand)
        errors += [entry["error"]["step_s"] for entry in strategy.log.entries[len(errors) :]]
        new = strategy.next_plan(step, plan, demand)
        move_s = _move_seconds(settings, trainer, plan, new)
        plan = new
    return ConfigRun(name, settings.gpus, steps, errors, model_errors)


def _with_overhead(result: StepResult, extra_s: float) -> StepResult:
    if not extra_s:
        return result
    return StepResult(
        result.step,
        result.train_workers,
        result.rollout_tps,
        result.rollout_s,
        result.train_s,
        result.overhead_s + extra_s,
        result.train_tokens,
        result.busy_worker_s,
        result.colocated,
    )


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
) -> tuple[StepResult, list[TrajectoryRecord]]:
    trainer = EmulatedTrainer(
        settings.fleet.gpu,
        settings.fleet.model,
        settings.training,
        seed=settings.seed * 7919 + step,
    )
    trainer.active = set(range(plan.train_workers))
    apps, calls = _fleet_apps(settings, plan, book, step)
    train_s = 0.0
    records: list[TrajectoryRecord] = []

    async def train() -> None:
        nonlocal train_s
        train_s = await trainer.step(train_tokens)

    started = anyio.current_time()
    if strategy.colocated:
        records = await _rollout(settings, strategy, plan, book, step, apps)
        rollout_s = anyio.current_time() - started
        await train()
        overhead = 2 * settings.serving.reload_s
    else:
        async with anyio.create_task_group() as group:
            group.start_soon(train)
            records = await _rollout(settings, strategy, plan, book, step, apps)
            rollout_s = anyio.current_time() - started
        overhead = settings.serving.sync_s(settings.fleet.model)
    for call in calls:
        strategy.observe_call(call)
    serving_busy = sum(
        tp * app.engine.busy_s
        for tp, app in zip(plan.rollout_tps, apps.values(), strict=True)
        if app.engine is not None
    )
    result = StepResult(
        step,
        plan.train_workers,
        plan.rollout_tps,
        rollout_s,
        train_s,
        overhead,
        sum(len(record.token_ids) for record in records),
        serving_busy + plan.train_workers * train_s,
        strategy.colocated,
    )
    return result, records


async def _rollout(
    settings: Settings,
    strategy: Strategy,
    plan: Plan,
    book: ScriptBook,
    step: int,
    apps: dict[str, EmulatorApp],
) -> list[TrajectoryRecord]:
    workload = settings.workload
    policy = make_policy(strategy.policy, _fleet_spec(settings, plan, apps))
    replay_history(policy, book, step)
    scripts = book.step(step)
    env_classes = EnvClasses(book)
    jobs = [
        TrajectoryJob(env_classes(step, s.sample), Task(s.task_id, s.task_seed), s.sample, step)
        for s in scripts
    ]
    records: list[TrajectoryRecord] = []
    async with ASGITransport(FleetApp(apps)) as http:
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
    settings: Settings, plan: Plan, book: ScriptBook, step: int
) -> tuple[dict[str, EmulatorApp], list[CallTiming]]:
    """One emulated server per instance of the plan, playing the truth, with a tap that
    reports each call as vLLM's per-request metrics would."""
    script = WorkloadScript(book)
    fleet, workload = settings.fleet, settings.workload
    apps: dict[str, EmulatorApp] = {}
    calls: list[CallTiming] = []
    for index, tp in enumerate(plan.rollout_tps):
        name = f"i{index}-tp{tp}"
        latency = settings.serving.latency(fleet.gpu, fleet.model, tp, fleet.serving.max_num_seqs)
        config = EmulatorConfig(
            model_name=MODEL,
            latency=latency,
            prefix_caching=fleet.serving.prefix_caching,
            max_model_len=workload.limits.max_context_tokens + 2 * _CONTEXT_MARGIN,
            seed=settings.seed * 100_003 + step * 101 + index,
        )
        app = apps[name] = create_app(config, script)
        assert app.engine is not None  # the truth's latency is never zero
        _tap(app.engine, name, tp, calls)
    return apps, calls


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
    )


def demand_of_scripts(scripts: list[TrajectoryScript]) -> Demand:
    """The same, from the earlier steps' scripts (what a run saw before this one)."""
    per_step = len(scripts) // max(1, len({s.step for s in scripts}))
    return Demand(
        trajectories=per_step,
        output_tokens=tuple(sum(turn.output_tokens for turn in s.turns) for s in scripts),
        context_tokens=tuple(_script_tokens(s) for s in scripts),
        turns=tuple(len(s.turns) for s in scripts),
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
