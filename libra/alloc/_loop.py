"""The allocation loop: after every RL step, decide whether hybrid workers move.

It sees what the run measured (every generation call's :class:`CallTiming`, every step's
:class:`StepTiming`), the router's live queue pressure, and the workload summary, and it
drives the :class:`HybridPool`. Two rules, the planner's first:

- **re-plan** when a :class:`ReplanTrigger` fires (on schedule, a rollout/train ratio
  far off, queue pressure, drifting lengths): the planner prices a split of every worker,
  and the pool moves towards it when it beats the current split by more than moving
  costs (the mean of the pool's moves so far) and the planner's margin;
- otherwise **borrow** one hybrid unit when training is slower than rollout by
  ``borrow_ratio`` (train/rollout time), and **release** one when it is faster by
  ``release_ratio``.

Either way it never borrows while the rollout is under pressure (the fraction of batch
slots of the serving instances in use, queued calls included), and it starts no move while
its last one is under way: the next step's timings show that move's effect first. (Moves
others start in the same pool, such as the rollout tail's lending inside a step, do not
hold it.) Moves run in
the pool's task group, so a decision returns at once. anyio only: any backend runs it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, Protocol

import anyio.abc
from pydantic import Field, NonNegativeFloat

from libra.alloc._moves import Move
from libra.alloc._planner import PlanLog, ReplanTrigger, mean_output
from libra.alloc._pool import HybridPool
from libra.alloc._protocol import CallTiming, Demand, Plan, Planner, StepTiming
from libra.config import Section

Action = Literal["hold", "borrow", "release", "plan"]


class ApplyingPlanner(Planner, Protocol):
    """A planner that also says when a new plan is worth moving to."""

    def should_apply(
        self, current: Plan, new: Plan, workload: Demand, move_cost_s: float
    ) -> bool: ...


class LoopConfig(Section):
    borrow_ratio: float = Field(1.15, gt=1, description="train/rollout time ratio that borrows")
    release_ratio: float = Field(
        0.90, gt=0, lt=1, description="train/rollout time ratio that releases"
    )
    max_pressure: float = Field(0.8, gt=0, description="rollout pressure that forbids borrowing")
    move_cost_s: NonNegativeFloat = Field(
        60.0, description="a move's cost before the pool has measured one"
    )
    trigger: ReplanTrigger = Field(default_factory=ReplanTrigger)


@dataclass(frozen=True, slots=True)
class AllocationDecision:
    """What the loop did after one step, and what it saw."""

    step: int
    action: Action
    ratio: float  # train / rollout seconds
    pressure: float
    reason: str = ""
    moves: tuple[Move, ...] = ()
    plan: Plan | None = None


@dataclass
class AllocationLoop:
    """Observes, asks the planner, drives the pool (see the module docstring)."""

    planner: ApplyingPlanner
    pool: HybridPool
    config: LoopConfig = field(default_factory=LoopConfig)
    log: PlanLog = field(default_factory=PlanLog)
    decisions: list[AllocationDecision] = field(default_factory=list)
    _steps_since_plan: int = 0
    _planned_mean_output: float = 0.0
    _moves: tuple[Move, ...] = ()  # the loop's last moves

    def observe_call(self, timing: CallTiming) -> None:
        self.planner.observe_call(timing)

    def pressure(self) -> float:
        """Calls in flight (queued ones included) per batch slot of the active instances
        (the sequences each runs at once, as many as its KV cache holds)."""
        serving = [i for i in self.pool.router.instances if i.state == "active"]
        slots = sum(instance.capacity for instance in serving)
        if slots == 0:
            return math.inf
        return sum(instance.in_flight for instance in serving) / slots

    def on_step(
        self, timing: StepTiming, workload: Demand, pressure: float | None = None
    ) -> AllocationDecision:
        """The step is over: learn from it and decide (``pressure``: measured now from
        the router unless given)."""
        self.planner.observe_step(timing, self.current_plan(), workload)
        self.log.record_measured(timing)
        self._steps_since_plan += 1
        pressure = self.pressure() if pressure is None else pressure
        ratio = timing.train_s / timing.rollout_s if timing.rollout_s > 0 else math.inf
        decision = self._decide(timing, workload, ratio, pressure)
        self.decisions.append(decision)
        self._moves = decision.moves or self._moves
        return decision

    async def run(self, steps: anyio.abc.ObjectReceiveStream[tuple[StepTiming, Demand]]) -> None:
        """Decide after every step received, until the stream closes."""
        async with steps:
            async for timing, workload in steps:
                self.on_step(timing, workload)

    # ------------------------------------------------------------------ deciding

    def _decide(
        self, timing: StepTiming, workload: Demand, ratio: float, pressure: float
    ) -> AllocationDecision:
        step = timing.step
        if any(move.outcome == "pending" for move in self._moves):
            return AllocationDecision(step, "hold", ratio, pressure, "a move is under way")
        reasons = self.config.trigger.reasons(
            steps_since_plan=self._steps_since_plan,
            timing=timing,
            queue_pressure=pressure,
            mean_output=mean_output(workload),
            planned_mean_output=self._planned_mean_output,
        )
        if reasons:
            planned = self._replan(step, workload, ratio, pressure, ", ".join(reasons))
            if planned is not None:
                return planned
        return self._rule(step, ratio, pressure)

    def _replan(
        self, step: int, workload: Demand, ratio: float, pressure: float, why: str
    ) -> AllocationDecision | None:
        self._steps_since_plan = 0
        self._planned_mean_output = mean_output(workload)
        try:
            plan = self.planner.plan(self.pool.cluster.workers, workload)
        except ValueError as error:  # nothing fits: keep the split the run has
            return AllocationDecision(step, "hold", ratio, pressure, f"{why}: {error}")
        current = self.current_plan()
        if not self.planner.should_apply(current, plan, workload, self._move_cost_s()):
            return None
        if plan.train_workers > current.train_workers and pressure >= self.config.max_pressure:
            return AllocationDecision(
                step, "hold", ratio, pressure, f"{why}: the plan borrows under pressure"
            )
        moves = tuple(self.pool.apply(plan))
        if not moves:
            return None  # no whole hybrid unit brings the pool closer to it
        self.log.record_plan(step + 1, plan)
        return AllocationDecision(step, "plan", ratio, pressure, why, moves, plan)

    def _rule(self, step: int, ratio: float, pressure: float) -> AllocationDecision:
        config = self.config
        if ratio >= config.borrow_ratio:
            if pressure >= config.max_pressure:
                return AllocationDecision(
                    step, "hold", ratio, pressure, "training is slower, rollout busy"
                )
            moves = tuple(self.pool.borrow(1))
            if moves:
                return AllocationDecision(
                    step, "borrow", ratio, pressure, "training is slower", moves
                )
            return AllocationDecision(
                step, "hold", ratio, pressure, "no hybrid unit left to borrow"
            )
        if ratio <= config.release_ratio:
            moves = tuple(self.pool.release(1))
            if moves:
                return AllocationDecision(
                    step, "release", ratio, pressure, "rollout is slower", moves
                )
            return AllocationDecision(step, "hold", ratio, pressure, "no borrowed unit to release")
        return AllocationDecision(step, "hold", ratio, pressure, "balanced")

    # ------------------------------------------------------------------ the pool now

    def current_plan(self) -> Plan:
        """The split the pool is in (or moving to), as a plan."""
        units = [u for u in self.pool.units if u.stage == "rollout" and not self.pool.lost(u)]
        tps = tuple(sorted((len(unit.workers) for unit in units), reverse=True))
        return Plan(self.pool.workers_in("training"), tps)

    def _move_cost_s(self) -> float:
        """The mean duration of the pool's finished moves (the configured guess before)."""
        spans = [m.ended - m.started for m in self.pool.moves if m.ended is not None]
        return sum(spans) / len(spans) if spans else self.config.move_cost_s
