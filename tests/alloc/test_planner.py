"""The roofline planner: feasible plans over every worker, the bottleneck moving workers,
the apply margin, the re-plan triggers and the plan log."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from libra.alloc import (
    A100,
    PlanLog,
    PlannerConfig,
    ReplanTrigger,
    RooflinePlanner,
    bucket_ceilings,
    tp_partitions,
)
from libra.alloc._protocol import CallTiming, Demand, Plan, Prediction, StepTiming
from libra.fleet import Model, Roofline

QWEN3_14B = Model(name="qwen3-14b", parameters=14.8e9, layers=40, kv_heads=8, head_dim=128)
#: A 70B-class model: its bf16 weights (144 GB) fit on neither one A100 nor two.
BIG = Model(name="big", parameters=72e9, layers=80, kv_heads=8, head_dim=128)
WORKLOAD = Demand(
    64,
    output_tokens=(300, 600, 1200, 2500, 5000, 9000),
    context_tokens=(2000, 2600, 3500, 5000, 8000, 13000),
)


def _planner(model: Model = QWEN3_14B) -> RooflinePlanner:
    return RooflinePlanner(Roofline(A100, model))


def test_partitions_use_exactly_the_workers() -> None:
    layouts = list(tp_partitions(6, (1, 2, 4), limit=32))
    assert all(sum(tps) == 6 for tps in layouts)
    assert all(list(tps) == sorted(tps, reverse=True) for tps in layouts)
    assert len(layouts) == len(set(layouts)) == 6
    assert list(tp_partitions(4, (4,), limit=32)) == [(4,)]
    assert list(tp_partitions(3, (2,), limit=32)) == []


@pytest.mark.parametrize("workers", [6, 9, 16])
def test_every_plan_fits_and_uses_every_worker(workers: int) -> None:
    planner = _planner()
    plan = planner.plan(workers, WORKLOAD)
    assert plan.workers == workers
    assert planner.feasible(plan)
    assert plan.train_workers >= 4  # 14.8B of training state needs four A100s
    assert plan.predicted is not None
    assert plan.predicted == planner.predict(plan, WORKLOAD)


def test_a_step_that_trains_the_last_steps_records_is_priced_on_them() -> None:
    """One step off-policy, a step trains what the last one generated: known when the
    step starts, so its training is priced on those tokens, not on the forecast's."""
    planner = _planner()
    plan = planner.plan(16, WORKLOAD)
    known = planner.predict(plan, WORKLOAD, trained_tokens=3_000_000)
    assert known.train_s == planner.train.seconds(3_000_000, plan.train_workers)
    assert known.rollout_s == planner.predict(plan, WORKLOAD).rollout_s


def test_the_rollout_is_calibrated_on_the_steps_measured() -> None:
    """What the call-level fit cannot see (where the routing ran the longest
    trajectory's turns) shows in the step: rollouts measured half again as long as the
    model gives the plan that ran scale every rollout priced after them."""
    planner = _planner()
    plan = planner.plan(16, WORKLOAD)
    modelled = planner.predict(plan, WORKLOAD).rollout_s
    for step, factor in enumerate((1.4, 1.5, 1.6)):
        timing = StepTiming(step, modelled * factor, 10.0, 1_000_000, plan.train_workers, 8)
        planner.observe_step(timing, plan, WORKLOAD)
    assert planner.rollout_scale == pytest.approx(1.5)
    assert planner.predict(plan, WORKLOAD).rollout_s == pytest.approx(1.5 * modelled)
    # Off, or without the plan and the workload that ran, the model stands as it is.
    off = RooflinePlanner(Roofline(A100, QWEN3_14B), PlannerConfig(rollout_calibration_steps=0))
    off.observe_step(
        StepTiming(0, 3 * modelled, 10.0, 1_000_000, plan.train_workers, 8), plan, WORKLOAD
    )
    planner.observe_step(StepTiming(3, 9 * modelled, 10.0, 1_000_000, plan.train_workers, 8))
    assert off.rollout_scale == 1.0 and planner.rollout_scale == pytest.approx(1.5)


def test_a_model_too_big_for_one_gpu_is_served_only_on_larger_tp() -> None:
    planner = _planner(BIG)
    plan = planner.plan(32, Demand(16, (500, 2000), (1500, 4000)))
    assert plan.workers == 32
    assert min(plan.rollout_tps) >= 4
    assert planner.feasible(plan)
    with pytest.raises(ValueError, match="no plan"):
        planner.plan(8, WORKLOAD)  # its training state needs more than 8


def test_workers_move_to_the_bottleneck() -> None:
    planner = _planner()
    first = planner.plan(16, WORKLOAD)
    tokens = 64 * 6000
    for step in range(4):  # training proves three times slower than the prior
        measured = 3 * planner.train.seconds(tokens, 8)
        planner.observe_step(StepTiming(step, 10.0, measured, tokens, 8, 8))
    train_bound = planner.plan(16, WORKLOAD)
    assert train_bound.train_workers > first.train_workers
    for tp in (1, 2, 4):  # then rollout proves five times slower than the prior
        for concurrent in (1, 8, 32, 64):
            call = CallTiming(f"tp{tp}", tp, 4000, 1000, 800, 0.0, concurrent)
            seconds = 5 * planner.rollout.predict_call(call)
            planner.observe_call(CallTiming(f"tp{tp}", tp, 4000, 1000, 800, seconds, concurrent))
    rollout_bound = planner.plan(16, WORKLOAD)
    assert rollout_bound.train_workers < train_bound.train_workers
    assert rollout_bound.reason == "rollout-bound"


def test_a_plan_is_applied_only_past_the_move_cost_and_the_margin() -> None:
    planner = _planner()
    best = planner.plan(16, WORKLOAD)
    worse = Plan(12, (1, 1, 1, 1))
    before = planner.predict(worse, WORKLOAD).step_s
    assert best.predicted is not None
    gain = before - best.predicted.step_s
    assert gain > 0.05 * before
    assert planner.should_apply(worse, best, WORKLOAD, move_cost_s=0.0)
    assert not planner.should_apply(worse, best, WORKLOAD, move_cost_s=gain * 1.01)
    assert not planner.should_apply(best, best, WORKLOAD, move_cost_s=0.0)
    strict = RooflinePlanner(Roofline(A100, QWEN3_14B), PlannerConfig(margin=gain / before + 0.01))
    assert not strict.should_apply(worse, best, WORKLOAD, move_cost_s=0.0)


def test_bucket_ceilings_follow_the_length_distribution() -> None:
    assert bucket_ceilings((4, 4), WORKLOAD) == ()
    ceilings = bucket_ceilings((4, 2, 1, 1), WORKLOAD)
    assert len(ceilings) == 3
    assert list(ceilings) == sorted(ceilings)
    assert ceilings[-1] == max(WORKLOAD.output_tokens)


def _reasons(
    trigger: ReplanTrigger,
    *,
    steps: int = 1,
    rollout_s: float = 10.0,
    pressure: float = 0.0,
    mean: float = 1000.0,
) -> tuple[str, ...]:
    timing = StepTiming(5, rollout_s=rollout_s, train_s=10.0, train_tokens=1, train_workers=4,
                        rollout_workers=4)  # fmt: skip
    return trigger.reasons(
        steps_since_plan=steps,
        timing=timing,
        queue_pressure=pressure,
        mean_output=mean,
        planned_mean_output=1000.0,
    )


def test_triggers_fire_on_schedule_ratio_pressure_and_drift() -> None:
    trigger = ReplanTrigger(every_steps=10)
    assert _reasons(trigger) == ()
    assert _reasons(trigger, steps=10) == ("schedule",)
    assert _reasons(trigger, rollout_s=12.5)[0].startswith("ratio")
    assert _reasons(trigger, rollout_s=8.0)[0].startswith("ratio")
    assert _reasons(trigger, rollout_s=11.0) == ()
    assert _reasons(trigger, pressure=0.8)[0].startswith("queue pressure")
    assert _reasons(trigger, mean=1300.0)[0].startswith("length drift")
    assert _reasons(trigger, mean=1100.0) == ()


def test_the_plan_log_sets_the_prediction_beside_the_measurement(tmp_path: Path) -> None:
    log = PlanLog(tmp_path / "plans.jsonl")
    plan = Plan(4, (2, 2), predicted=Prediction(rollout_s=30.0, train_s=20.0, step_s=30.0))
    log.record_plan(7, plan)
    assert log.record_measured(StepTiming(6, 1.0, 1.0, 1, 4, 4)) is None  # no plan for it
    entry = log.record_measured(StepTiming(7, rollout_s=25.0, train_s=20.0, train_tokens=1,
                                           train_workers=4, rollout_workers=4))  # fmt: skip
    assert entry is not None
    assert entry["error"]["rollout_s"] == pytest.approx(0.2)
    assert entry["error"]["train_s"] == pytest.approx(0.0)
    lines = [json.loads(line) for line in (tmp_path / "plans.jsonl").read_text().splitlines()]
    assert [line["event"] for line in lines] == ["plan", "measured"]
    assert lines[1]["measured"]["step_s"] == 25.0
    assert lines[1]["predicted"]["step_s"] == 30.0
    assert log.entries == [entry]
