"""The configurations ``libra bench alloc`` compares, each a strategy object.

A strategy owns the layout: the first :class:`~libra.alloc.Plan`, what it learns from every
step (the calls and the step timing a real run would report) and the plan of the next
step. The run in :mod:`libra.bench._alloc` plays whatever plan it is handed and charges
its moves. A strategy with a ``tail`` rule also runs the hybrid pool inside each step
(workers moving between rollout and training, ``libra.alloc`` driving an emulated
cluster).
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from libra.alloc import (
    CallTiming,
    Demand,
    LongestDecodes,
    Plan,
    PlanLog,
    PlannerConfig,
    ReplanTrigger,
    RooflinePlanner,
    StepTiming,
    TailRule,
    TrainCost,
    bucket_ceilings,
    mean_output,
    tp_partitions,
)
from libra.fleet import Gpu, Model, Roofline

#: train:rollout worker ratios of the static baselines, as the train share of the workers.
STATIC_SHARES = (0.25, 0.5, 0.75)
#: The split a user picks without measuring: half the workers train, half serve at TP1.
UPFRONT_SHARE = 0.5
#: What the planner believes a re-layout costs before it has made one (a server restart).
MOVE_COST_PRIOR_S = 60.0
#: The instance sizes the planners may lay out.
ALLOWED_TPS = (1, 2, 4)


@dataclass
class Strategy:
    """A configuration whose layout never changes: a static split, or colocated."""

    name: str
    plan: Plan
    policy: str = "least-loaded"
    colocated: bool = False
    log: PlanLog = field(default_factory=PlanLog)
    #: The hybrid pool's in-step rule (None: the layout holds for the whole step).
    tail: TailRule | None = None

    def first_plan(self, workers: int, workload: Demand) -> Plan:
        return self.plan

    def observe_call(self, timing: CallTiming) -> None:
        """Static configurations learn nothing."""

    def observe_step(self, timing: StepTiming, plan: Plan, ran: Demand) -> None:
        """Static configurations learn nothing."""

    def predict(self, step: int, plan: Plan, workload: Demand, trained_tokens: int) -> None:
        """Static configurations predict nothing."""

    def next_plan(self, step: int, current: Plan, workload: Demand) -> Plan:
        return current

    def expected_train_s(self, plan: Plan, tokens: int) -> float:
        """Seconds training ``tokens`` on the plan's workers should take (0: no model)."""
        return 0.0

    def hindsight(self, plan: Plan, ran: Demand, trained_tokens: int) -> float | None:
        """The step time the cost model gives ``plan`` on the workload the step turned out
        to be, training ``trained_tokens`` (its error is the model's, without the
        forecast's); None: no model."""
        return None


@dataclass
class PlannerStrategy(Strategy):
    """The roofline planner: plans from its prior before the first step, fits its costs
    from every call and step, re-plans on its triggers and moves when the gain beats the
    move's cost."""

    planner: RooflinePlanner | None = None
    trigger: ReplanTrigger = field(default_factory=ReplanTrigger)
    _since_plan: int = 0
    _planned_mean: float = 0.0
    _last: StepTiming | None = None
    _ratios: deque[float] = field(default_factory=lambda: deque(maxlen=4))

    def _planner(self) -> RooflinePlanner:
        assert self.planner is not None, "a planner strategy is built with its planner"
        return self.planner

    def first_plan(self, workers: int, workload: Demand) -> Plan:
        plan = self._planner().plan(workers, workload)
        self._planned_mean = mean_output(workload)
        return plan

    def observe_call(self, timing: CallTiming) -> None:
        self._planner().observe_call(timing)

    def observe_step(self, timing: StepTiming, plan: Plan, ran: Demand) -> None:
        self._planner().observe_step(timing, plan, ran)
        self.log.record_measured(timing)
        self._last = timing
        self._since_plan += 1

    def predict(self, step: int, plan: Plan, workload: Demand, trained_tokens: int) -> None:
        """Log what the planner expects of ``plan`` on the step about to run, whose
        training step trains ``trained_tokens`` (the last step's records)."""
        predicted = self._planner().predict(plan, workload, trained_tokens)
        self.log.record_plan(step, Plan(plan.train_workers, plan.rollout_tps, predicted=predicted))

    def hindsight(self, plan: Plan, ran: Demand, trained_tokens: int) -> float | None:
        return self._planner().predict(plan, ran, trained_tokens).step_s

    def expected_train_s(self, plan: Plan, tokens: int) -> float:
        return self._planner().train.seconds(tokens, plan.train_workers)

    def next_plan(self, step: int, current: Plan, workload: Demand) -> Plan:
        timing, planner = self._last, self._planner()
        if timing is None:
            return current
        reasons = self.trigger.reasons(
            steps_since_plan=self._since_plan,
            timing=timing,
            queue_pressure=0.0,
            mean_output=mean_output(workload),
            planned_mean_output=self._planned_mean,
        )
        if not reasons:
            return current
        candidate = planner.plan(current.workers, workload)
        self._since_plan, self._planned_mean = 0, mean_output(workload)
        if planner.should_apply(current, candidate, workload, MOVE_COST_PRIOR_S):
            return candidate
        return current


@dataclass
class LayoutStrategy(Strategy):
    """One layout held for the whole run, routed as full Libra routes (C-MLFQ, one
    bucket per instance size with the planner's ceilings) unless told otherwise: the
    best of these in hindsight is what a planner that knew the run's future could pick."""

    policy: str = "cmlfq"

    def first_plan(self, workers: int, workload: Demand) -> Plan:
        tps = self.plan.rollout_tps
        return Plan(self.plan.train_workers, tps, bucket_ceilings(tps, workload), reason="held")


def static_plan(workers: int, train_share: float) -> Plan:
    train = min(workers - 1, max(1, round(workers * train_share)))
    return Plan(train, (1,) * (workers - train), reason=f"static {train}:{workers - train}")


def strategies(
    gpu: Gpu,
    model: Model,
    workers: int,
    tail: TailRule | None = None,
    layouts: Sequence[Plan] = (),
    layout_policy: str = "cmlfq",
) -> list[Strategy]:
    """Every configuration of the benchmark on ``workers`` GPUs: static splits whose
    training state fits, colocated, the planner with its datasheet prior and with that
    prior 30% optimistic and 30% pessimistic, the planner with C-MLFQ (``libra-no-pool``),
    and full Libra: that, and the hybrid pool lending the rollout's idle tail to training
    inside every step; then each of ``layouts`` held for the whole run and routed by
    ``layout_policy`` (:class:`LayoutStrategy`), named by :func:`layout_name`."""
    fits = TrainCost(gpu, model.parameters).fits
    found: list[Strategy] = []
    for share in STATIC_SHARES:
        plan = static_plan(workers, share)
        if fits(plan.train_workers):
            found.append(Strategy(static_name(share), plan))
    colocated = Plan(workers, (1,) * workers, reason="colocated")
    found.append(Strategy("colocated", colocated, colocated=True))
    # Each planner is told how its run routes (its own config, not the emulator's truth).
    for label, scale in (("planner", 1.0), ("planner-prior+30%", 1.3), ("planner-prior-30%", 0.7)):
        planner = _planner(gpu, model, scale, "in_batch")
        found.append(PlannerStrategy(label, Plan(0, ()), planner=planner))
    found.append(
        PlannerStrategy(
            "libra-no-pool", Plan(0, ()), policy="cmlfq", planner=_planner(gpu, model, 1.0)
        )
    )
    found.append(
        PlannerStrategy(
            "libra",
            Plan(0, ()),
            policy="cmlfq",
            planner=_planner(gpu, model, 1.0),
            tail=tail or TailRule(),
        )
    )
    for plan in layouts:
        name = layout_name(plan.train_workers, plan.rollout_tps)
        found.append(LayoutStrategy(name, plan, policy=layout_policy))
    return found


def layout_name(train: int, tps: Sequence[int]) -> str:
    """``5T/2xTP4+1xTP2``: 5 workers training, two TP4 instances and one TP2 serving."""
    counts = {tp: list(tps).count(tp) for tp in sorted(set(tps), reverse=True)}
    return f"{train}T/" + "+".join(f"{n}xTP{tp}" for tp, n in counts.items())


_LAYOUT = re.compile(r"(\d+)T/(\d+xTP\d+(?:\+\d+xTP\d+)*)")


def parse_layout(name: str) -> Plan:
    """The plan :func:`layout_name` names; ValueError for anything else."""
    match = _LAYOUT.fullmatch(name.strip())
    if match is None:
        raise ValueError(f"a layout is written like 5T/2xTP4+1xTP2, not {name!r}")
    tps: list[int] = []
    for part in match[2].split("+"):
        count, tp = part.split("xTP")
        tps += [int(tp)] * int(count)
    return Plan(int(match[1]), tuple(sorted(tps, reverse=True)))


def every_layout(gpu: Gpu, model: Model, workers: int) -> Iterator[Plan]:
    """Every split of ``workers`` the planners may choose: training on workers that hold
    its state, the rest in instances of :data:`ALLOWED_TPS` whose KV cache has room."""
    fits, roofline = TrainCost(gpu, model.parameters).fits, Roofline(gpu, model)
    sizes = tuple(tp for tp in ALLOWED_TPS if roofline.kv_capacity_tokens(tp) > 0)
    for train in range(1, workers):
        if fits(train):
            for tps in tp_partitions(workers - train, sizes, workers):
                yield Plan(train, tps)


def static_name(share: float) -> str:
    train = round(share * 4)
    return f"static-{train}:{4 - train}"


def _planner(
    gpu: Gpu, model: Model, scale: float, longest_decodes: LongestDecodes = "alone"
) -> RooflinePlanner:
    """A planner whose prior believes the GPU ``scale`` times as fast as its datasheet."""
    believed = gpu.model_copy(
        update={
            "hbm_bytes_per_s": gpu.hbm_bytes_per_s * scale,
            "dense_bf16_flops": gpu.dense_bf16_flops * scale,
        }
    )
    config = PlannerConfig(allowed_tps=ALLOWED_TPS, longest_decodes=longest_decodes)
    return RooflinePlanner(Roofline(believed, model), config)
