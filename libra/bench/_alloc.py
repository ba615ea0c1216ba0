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

from libra.alloc import Plan, StepTiming, instance_name
from libra.bench._alloc_demand import demand_of_records, demand_of_scripts, script_tokens
from libra.bench._alloc_fleet import fleet_apps, fleet_spec, layout_of, serving_units, step_cluster
from libra.bench._alloc_settings import Settings
from libra.bench._alloc_steps import colocated_step, pooled_step, split_step
from libra.bench._alloc_strategies import Strategy, strategies
from libra.bench._emulated_fleet import in_virtual_time
from libra.bench._sched_history import truth_of
from libra.emulation import EmulatedTrainer, FleetApp
from libra.emulation.workloads import ScriptBook
from libra.engine import TrajectoryRecord
from libra.sched.policies import ORACLES, make_policy


@dataclass(frozen=True)
class StepResult:
    step: int
    train_workers: int
    rollout_tps: tuple[int, ...]
    rollout_s: float
    train_s: float
    overhead_s: float  # weight sync, switches and moves
    train_tokens: int  # its records' tokens, which the next step trains
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
    """Every step of configuration ``name``, in virtual time; deterministic for a seed
    (but for the pool's: one run in a few lends at another moment of a step's tail)."""
    return in_virtual_time(_run_config, settings, name, seed=settings.seed)


def config_names(settings: Settings) -> list[str]:
    return [s.name for s in _strategies(settings)]


def _strategies(settings: Settings) -> list[Strategy]:
    fleet = settings.fleet
    return strategies(
        fleet.gpu,
        fleet.model,
        settings.gpus,
        settings.tail,
        settings.layouts,
        settings.layout_policy,
    )


async def _run_config(settings: Settings, name: str) -> ConfigRun:
    fleet = settings.fleet
    strategy = next(s for s in _strategies(settings) if s.name == name)
    book = ScriptBook(settings.workload, settings.seed)
    first = settings.workload.rollout.history_steps
    history = [script for k in range(max(0, first - 2), first) for script in book.step(k)]
    demand = demand_of_scripts(history)
    plan = strategy.first_plan(settings.gpus, demand)
    trainer = EmulatedTrainer(fleet.gpu, fleet.model, settings.training, seed=settings.seed)
    pending_tokens = sum(script_tokens(script) for script in book.step(first - 1))
    recent: list[list[TrajectoryRecord]] = []
    steps: list[StepResult] = []
    errors: list[float] = []
    model_errors: list[float] = []
    move_s = 0.0
    lent: tuple[tuple[tuple[int, ...], str], ...] = ()
    for step in range(first, first + settings.steps):
        trained_tokens = pending_tokens  # one step off-policy: the last step's records
        strategy.predict(step, plan, demand, trained_tokens)
        # What training should take, from what the run measured (the planner's fit).
        expected_train_s = strategy.expected_train_s(plan, trained_tokens)
        result, records = await _one_step(
            settings, strategy, plan, book, step, trained_tokens, lent, expected_train_s
        )
        result = _with_overhead(result, move_s)
        steps.append(result)
        pending_tokens = result.train_tokens
        ran = demand_of_records([records])
        hindsight = strategy.hindsight(plan, ran, trained_tokens)
        if hindsight is not None:
            model_errors.append(hindsight / max(result.rollout_s, result.train_s) - 1)
        recent = [*recent[-1:], records]
        demand = demand_of_records(recent)
        timing = StepTiming(
            step,
            result.rollout_s,
            result.train_s,
            trained_tokens,
            # What trained, on average: the pool's lent workers took a share of the step.
            max(plan.train_workers, round(result.mean_train_workers)),
            plan.rollout_workers,
        )
        strategy.observe_step(timing, plan, ran)
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
    units = serving_units(plan)
    # The pool names an instance by its workers (it moves them); the rest by position.
    names = [
        instance_name(unit) if pooled else f"i{index}-tp{len(unit)}"
        for index, unit in enumerate(units)
    ]
    apps, calls = fleet_apps(settings, plan, book, step, names)
    # An oracle reads the truth: the step's scripts, every turn's future.
    truth = truth_of(book.step(step)) if strategy.policy in ORACLES else None
    policy = make_policy(strategy.policy, fleet_spec(settings, plan, apps), truth=truth)
    fleet = FleetApp(apps)
    lent_units = {unit for unit, _ in lent}
    for name, unit in zip(names, units, strict=True):
        if unit in lent_units:  # it comes back during this step: not serving yet
            policy.router.remove(name)
            fleet.remove(name)
    if pooled:
        cluster = step_cluster(settings, book, step, trainer, fleet, units, names)
        run = await pooled_step(
            settings,
            strategy,
            plan,
            book,
            step,
            trainer,
            train_tokens,
            policy,
            cluster,
            layout_of(plan, units, lent),
            expected_train_s,
        )
    elif strategy.colocated:
        run = await colocated_step(settings, policy, book, step, trainer, train_tokens, fleet)
    else:
        run = await split_step(settings, policy, book, step, trainer, train_tokens, fleet)
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


# ------------------------------------------------------------------------ all of them


def run_alloc_bench(settings: Settings, names: list[str], jobs: int = 1) -> list[ConfigRun]:
    """Every configuration; ``jobs`` > 1 runs them in parallel processes (the same
    numbers: each run is deterministic on its own, the pool's nearly)."""
    if jobs > 1 and len(names) > 1:
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(min(jobs, len(names)), mp_context=context) as pool:
            futures = [pool.submit(run_config, settings, name) for name in names]
            return [future.result() for future in futures]
    return [run_config(settings, name) for name in names]
