"""The roofline planner: the split of workers that minimises max(T_train, T_rollout).

Outer loop over training worker counts, inner loop over the partitions of the remaining
workers into instances of the allowed TP sizes; plans whose training state or whose
served weights do not fit are pruned. Costs come from :mod:`libra.alloc._cost`, fitted
from the run's observations. Also here: when to re-plan (:class:`ReplanTrigger`), when a
plan is worth moving to (:meth:`RooflinePlanner.should_apply`), and the log that sets
every plan's prediction beside what was then measured (:class:`PlanLog`).
"""

from __future__ import annotations

import json
import math
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median
from typing import Any

from pydantic import Field, PositiveInt

from libra.alloc._cost import (
    LongestDecodes,
    RolloutCost,
    TrainCost,
    TrainSpec,
    mean,
    train_tokens,
)
from libra.alloc._protocol import CallTiming, Demand, Plan, Prediction, StepTiming
from libra.config import Section
from libra.fleet import Roofline


class PlannerConfig(Section):
    allowed_tps: tuple[PositiveInt, ...] = (1, 2, 4, 8)
    min_train_workers: PositiveInt = 1
    margin: float = Field(0.05, ge=0, description="relative gain a new plan must bring")
    max_num_seqs: PositiveInt = 256
    max_instances: PositiveInt = Field(32, description="rollout instances a layout may have")
    placement_samples: PositiveInt = Field(
        64, description="length quantiles placed when pricing a layout (each stands for its share)"
    )
    train: TrainSpec = Field(default_factory=TrainSpec)
    longest_decodes: LongestDecodes = Field(
        "alone",
        description="the routing's treatment of the longest trajectory: 'alone' (C-MLFQ) "
        "or 'in_batch' (least-loaded, round-robin)",
    )
    rollout_calibration_steps: int = Field(
        4,
        ge=0,
        description="recent steps whose measured rollout over the model's (on the plan it "
        "ran and the workload it turned out to be) scales every rollout priced; 0: none",
    )


def tp_partitions(workers: int, sizes: tuple[int, ...], limit: int) -> Iterator[tuple[int, ...]]:
    """Every multiset of ``sizes`` summing to ``workers`` (at most ``limit`` parts), largest
    first."""
    ordered = sorted(set(sizes), reverse=True)

    def walk(left: int, start: int, prefix: tuple[int, ...]) -> Iterator[tuple[int, ...]]:
        if left == 0:
            yield prefix
            return
        if len(prefix) >= limit:
            return
        for i in range(start, len(ordered)):
            if ordered[i] <= left:
                yield from walk(left - ordered[i], i, (*prefix, ordered[i]))

    yield from walk(workers, 0, ())


def bucket_ceilings(tps: tuple[int, ...], workload: Demand) -> tuple[int, ...]:
    """One bucket per TP size, smallest TP for the shortest: ceilings at the quantiles of
    the output lengths in proportion to the workers each size holds."""
    sizes = sorted(set(tps))
    lengths = sorted(workload.output_tokens)
    if len(sizes) < 2 or not lengths:
        return ()
    total = sum(tps)
    ceilings: list[int] = []
    share = 0
    for size in sizes[:-1]:
        share += sum(tp for tp in tps if tp == size)
        ceilings.append(lengths[min(len(lengths) - 1, len(lengths) * share // total)])
    ceilings.append(lengths[-1])
    return tuple(ceilings)


#: The furthest the step-level calibration scales the model's rollout either way (a
#: step torn by a fault says little of the next).
_MAX_SCALE = 2.0


class RooflinePlanner:
    """A :class:`~libra.alloc.Planner` pricing plans with fitted roofline costs."""

    def __init__(self, roofline: Roofline, config: PlannerConfig | None = None) -> None:
        self.config = config or PlannerConfig()
        self.rollout = RolloutCost(
            roofline,
            max_num_seqs=self.config.max_num_seqs,
            placement_samples=self.config.placement_samples,
            longest_decodes=self.config.longest_decodes,
        )
        self.train = TrainCost(roofline.gpu, roofline.model.parameters, self.config.train)
        self._rollout_ratios: deque[float] = deque(maxlen=self.config.rollout_calibration_steps)

    def observe_call(self, timing: CallTiming) -> None:
        self.rollout.observe(timing)

    def observe_step(
        self, timing: StepTiming, plan: Plan | None = None, ran: Demand | None = None
    ) -> None:
        """A step is over: fit training to it; given the ``plan`` it ran and the workload
        it turned out to be, calibrate the rollout too. The calls fit each instance's
        costs, but not where the routing ran the longest trajectory's turns (C-MLFQ
        learns a straggler late, so its first turns run where short ones do) nor the
        moves that re-prefill a context: the measured rollout over the model's, a median
        of the last few steps, scales every rollout the planner prices."""
        self.train.observe(timing)
        if plan is None or ran is None or not self._rollout_ratios.maxlen:
            return
        modelled = self.rollout.makespan(plan.rollout_tps, ran)
        if timing.rollout_s > 0 and 0 < modelled < math.inf:
            self._rollout_ratios.append(timing.rollout_s / modelled)

    @property
    def rollout_scale(self) -> float:
        """The measured rollout over the model's, recent steps' median (1: none yet)."""
        ratios = self._rollout_ratios
        return min(_MAX_SCALE, max(1 / _MAX_SCALE, median(ratios))) if ratios else 1.0

    def _rollout_s(self, tps: tuple[int, ...], workload: Demand) -> float:
        return self.rollout.makespan(tps, workload) * self.rollout_scale

    def predict(
        self, plan: Plan, workload: Demand, trained_tokens: int | None = None
    ) -> Prediction:
        """The step ``plan`` takes on ``workload``; ``trained_tokens``: what its training
        step trains, when known (one step off-policy, the last step's records), else the
        workload's own."""
        rollout_s = self._rollout_s(plan.rollout_tps, workload)
        tokens = train_tokens(workload) if trained_tokens is None else trained_tokens
        train_s = (
            self.train.seconds(tokens, plan.train_workers) if plan.train_workers > 0 else math.inf
        )
        return Prediction(rollout_s, train_s, max(rollout_s, train_s))

    def feasible(self, plan: Plan) -> bool:
        return self.train.fits(plan.train_workers) and all(
            self.rollout.weights_fit(tp) for tp in plan.rollout_tps
        )

    def plan(self, workers: int, workload: Demand) -> Plan:
        tokens = train_tokens(workload)
        best: Plan | None = None
        # Most training workers first: small rollout searches set the bound early, and
        # every split whose training alone exceeds it is skipped unpriced.
        for train_workers in reversed(range(self.config.min_train_workers, workers)):
            if not self.train.fits(train_workers):
                continue
            train_s = self.train.seconds(tokens, train_workers)
            bound = best.predicted.step_s if best and best.predicted else math.inf
            if train_s >= bound:
                continue  # the step can be no shorter than its training
            found = self._best_layout(workers - train_workers, workload, bound)
            if found is not None:
                tps, rollout_s = found
                predicted = Prediction(rollout_s, train_s, max(rollout_s, train_s))
                if predicted.step_s < bound:
                    best = Plan(train_workers, tps, predicted=predicted)
        if best is None or best.predicted is None:
            raise ValueError(f"no plan of {workers} workers fits this model in memory")
        reason = "rollout-bound" if _rollout_bound(best.predicted) else "train-bound"
        ceilings = bucket_ceilings(best.rollout_tps, workload)
        return Plan(best.train_workers, best.rollout_tps, ceilings, best.predicted, reason)

    def _best_layout(
        self, workers: int, workload: Demand, bound: float
    ) -> tuple[tuple[int, ...], float] | None:
        """The fastest layout of ``workers`` whose makespan is under ``bound``; layouts
        whose largest instance cannot run the longest request under it are not priced."""
        scale = self.rollout_scale
        longest = {
            tp: self.rollout.longest_alone(tp, workload) * scale for tp in self.config.allowed_tps
        }
        best: tuple[tuple[int, ...], float] | None = None
        for tps in self._layouts(workers):
            if longest[tps[0]] >= bound:
                continue
            seconds = self._rollout_s(tps, workload)
            if seconds < bound:
                best, bound = (tps, seconds), seconds
        return best

    def _layouts(self, workers: int) -> Iterator[tuple[int, ...]]:
        sizes = tuple(tp for tp in self.config.allowed_tps if self.rollout.weights_fit(tp))
        return tp_partitions(workers, sizes, self.config.max_instances)

    def should_apply(self, current: Plan, new: Plan, workload: Demand, move_cost_s: float) -> bool:
        """Move when the step-time gain beats the cost of moving and by the margin."""
        before = self.predict(current, workload).step_s
        after = self.predict(new, workload).step_s
        gain = before - after
        if not math.isfinite(before):
            return math.isfinite(after)
        return gain - move_cost_s > 0 and gain >= self.config.margin * before


def _rollout_bound(prediction: Prediction) -> bool:
    return prediction.rollout_s >= prediction.train_s


# ----------------------------------------------------------------------------- triggers


class ReplanTrigger(Section):
    every_steps: PositiveInt = Field(10, description="re-plan at least this often")
    ratio_high: float = Field(1.25, gt=1, description="rollout/train time ratio that re-plans")
    ratio_low: float = Field(0.8, gt=0, lt=1, description="and the ratio below which it does")
    queue_pressure: float = Field(0.75, gt=0, description="rollout queue pressure that re-plans")
    length_drift: float = Field(0.2, gt=0, description="relative drift of the mean output length")

    def reasons(
        self,
        *,
        steps_since_plan: int,
        timing: StepTiming,
        queue_pressure: float,
        mean_output: float,
        planned_mean_output: float,
    ) -> tuple[str, ...]:
        """Why to re-plan now (empty: keep the plan)."""
        found: list[str] = []
        if steps_since_plan >= self.every_steps:
            found.append("schedule")
        ratio = timing.rollout_s / timing.train_s if timing.train_s > 0 else math.inf
        if ratio >= self.ratio_high or ratio <= self.ratio_low:
            found.append(f"ratio {ratio:.2f}")
        if queue_pressure >= self.queue_pressure:
            found.append(f"queue pressure {queue_pressure:.2f}")
        if planned_mean_output > 0:
            drift = abs(mean_output - planned_mean_output) / planned_mean_output
            if drift > self.length_drift:
                found.append(f"length drift {drift:.0%}")
        return tuple(found)


def mean_output(workload: Demand) -> float:
    return mean(workload.output_tokens) if workload.output_tokens else 0.0


# ----------------------------------------------------------------------------- the log


@dataclass(slots=True)
class PlanLog:
    """Every plan with its prediction, then with what its step measured (JSON lines)."""

    path: Path | None = None
    entries: list[dict[str, Any]] = field(default_factory=list)
    _pending: dict[int, dict[str, Any]] = field(default_factory=dict)

    def record_plan(self, step: int, plan: Plan) -> None:
        predicted = plan.predicted
        entry: dict[str, Any] = {
            "step": step,
            "train_workers": plan.train_workers,
            "rollout_tps": list(plan.rollout_tps),
            "bucket_ceilings": list(plan.bucket_ceilings),
            "reason": plan.reason,
            "predicted": _times(predicted.rollout_s, predicted.train_s) if predicted else None,
        }
        self._pending[step] = entry
        self._write({"event": "plan", **entry})

    def record_measured(self, timing: StepTiming) -> dict[str, Any] | None:
        """Set the measured step beside its plan's prediction; None when no plan awaits it."""
        entry = self._pending.pop(timing.step, None)
        if entry is None:
            return None
        entry["measured"] = _times(timing.rollout_s, timing.train_s)
        if entry["predicted"] is not None:
            entry["error"] = {
                key: entry["predicted"][key] / entry["measured"][key] - 1
                for key in entry["measured"]
                if entry["measured"][key] > 0
            }
        self.entries.append(entry)
        self._write({"event": "measured", **entry})
        return entry

    def _write(self, record: dict[str, Any]) -> None:
        if self.path is not None:
            with self.path.open("a", encoding="utf-8") as out:
                out.write(json.dumps(record, allow_nan=False) + "\n")


def _times(rollout_s: float, train_s: float) -> dict[str, float]:
    return {"rollout_s": rollout_s, "train_s": train_s, "step_s": max(rollout_s, train_s)}
