"""The allocation loop over the hybrid pool on the emulated cluster, in virtual time: it
borrows when training is slower and releases when rollout is, never borrows under rollout
pressure, waits for a move to end, and moves to a re-plan that pays for its move."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest
from trio.testing import MockClock

from libra.alloc import (
    A100,
    AllocationLoop,
    Demand,
    HybridPool,
    LoopConfig,
    ReplanTrigger,
    RooflinePlanner,
    StepTiming,
    start_layout,
)
from libra.fleet import Roofline
from libra.sched import Route, Router, RouteRequest
from tests._helpers import POOL_CONFIG, POOL_LAYOUT, SMALL_MODEL, emulated_cluster

pytestmark = pytest.mark.anyio

WORKLOAD = Demand(64, output_tokens=(300, 900, 2500), context_tokens=(2000, 3500, 8000))
#: A trigger that never fires: the ratio rule alone decides.
QUIET = ReplanTrigger(
    every_steps=10_000, ratio_high=1e9, ratio_low=1e-9, queue_pressure=1e9, length_drift=1e9
)
RULE_ONLY = LoopConfig(trigger=QUIET)


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, Any]]:
    """Trio with a clock that jumps whenever every task sleeps: virtual time."""
    return "trio", {"clock": MockClock(autojump_threshold=0)}


@asynccontextmanager
async def loop_over_pool(
    config: LoopConfig = RULE_ONLY,
) -> AsyncIterator[AllocationLoop]:
    cluster = emulated_cluster()
    pool_config = POOL_CONFIG.model_copy(update={"max_num_seqs": 4})  # 12 batch slots in all
    fleet = await start_layout(cluster, POOL_LAYOUT, pool_config)
    planner = RooflinePlanner(Roofline(A100, SMALL_MODEL))
    async with HybridPool(cluster, Router(fleet), POOL_LAYOUT, pool_config) as pool:
        yield AllocationLoop(planner, pool, config)


def step(number: int, rollout_s: float, train_s: float, train_workers: int = 1) -> StepTiming:
    return StepTiming(
        step=number,
        rollout_s=rollout_s,
        train_s=train_s,
        train_tokens=100_000,
        train_workers=train_workers,
        rollout_workers=4 - train_workers,
    )


def occupy(router: Router, calls: int) -> list[Route]:
    """``calls`` calls in flight, spread over the instances as a policy would."""
    routes = []
    for index in range(calls):
        instance = router.least_loaded(router.available())
        request = RouteRequest(f"t{index}", "p", 0, 1000, env="calc")
        routes.append(router.acquire(instance, request))
    return routes


async def test_a_move_the_loop_did_not_start_does_not_hold_it() -> None:
    async with loop_over_pool() as loop:
        [lent] = loop.pool.borrow(1)  # as the rollout's tail lends inside a step
        assert lent.unit == "w3" and loop.pool.pending() == [lent]
        decision = loop.on_step(step(1, rollout_s=100, train_s=120), WORKLOAD)
        assert decision.action == "borrow" and [m.unit for m in decision.moves] == ["w2"]
        held = loop.on_step(step(2, rollout_s=100, train_s=120), WORKLOAD)
        assert (held.action, held.reason) == ("hold", "a move is under way")
        await loop.pool.settled()
        assert loop.pool.training_workers() == (0, 2, 3)


async def test_it_borrows_when_training_is_slower_and_releases_when_rollout_is() -> None:
    async with loop_over_pool() as loop:
        pool = loop.pool
        first = loop.on_step(step(1, rollout_s=100, train_s=120), WORKLOAD)
        assert (first.action, first.reason) == ("borrow", "training is slower")
        assert first.ratio == pytest.approx(1.2)
        held = loop.on_step(step(2, rollout_s=100, train_s=200), WORKLOAD)
        assert (held.action, held.reason) == ("hold", "a move is under way")
        await pool.settled()
        assert pool.training_workers() == (0, 3)

        balanced = loop.on_step(step(3, rollout_s=100, train_s=100), WORKLOAD)
        assert (balanced.action, balanced.moves) == ("hold", ())
        second = loop.on_step(step(4, rollout_s=100, train_s=130), WORKLOAD)
        assert second.action == "borrow"
        await pool.settled()
        assert pool.training_workers() == (0, 2, 3)
        spent = loop.on_step(step(5, rollout_s=100, train_s=130), WORKLOAD)
        assert (spent.action, spent.reason) == ("hold", "no hybrid unit left to borrow")

        back = loop.on_step(step(6, rollout_s=100, train_s=85), WORKLOAD)
        assert (back.action, back.reason) == ("release", "rollout is slower")
        await pool.settled()
        assert pool.training_workers() == (0, 2)
        assert pool.router.by_name["w3"].state == "active"
    assert [d.action for d in loop.decisions] == [
        "borrow",
        "hold",
        "hold",
        "borrow",
        "hold",
        "release",
    ]


async def test_it_does_not_borrow_under_rollout_pressure() -> None:
    async with loop_over_pool() as loop:
        router = loop.pool.router
        routes = occupy(router, 10)  # 10 of 12 batch slots in use
        assert loop.pressure() == pytest.approx(10 / 12)
        busy = loop.on_step(step(1, rollout_s=100, train_s=150), WORKLOAD)
        assert (busy.action, busy.reason) == ("hold", "training is slower, rollout busy")
        assert loop.pool.moves == []
        for route in routes[:4]:
            router.release(route, outcome="ok")
        assert loop.pressure() == pytest.approx(6 / 12)
        calm = loop.on_step(step(2, rollout_s=100, train_s=150), WORKLOAD)
        assert calm.action == "borrow"
        for route in routes[4:]:
            router.release(route, outcome="ok")  # the drain waits for these
        await loop.pool.settled()
        assert loop.pool.training_workers() == (0, 3)


async def test_a_replan_that_pays_for_its_move_is_applied_and_logged() -> None:
    # Huge training contexts and short outputs: the step is all training.
    heavy = Demand(512, output_tokens=(20, 30, 40), context_tokens=(60_000, 80_000, 100_000))
    async with loop_over_pool(LoopConfig(trigger=ReplanTrigger(every_steps=1))) as loop:
        decision = loop.on_step(step(1, rollout_s=10, train_s=10), heavy)
        assert decision.action == "plan" and decision.reason == "schedule"
        assert decision.plan is not None and decision.plan.train_workers == 3
        assert [move.unit for move in decision.moves] == ["w2", "w3"]
        await loop.pool.settled()
        assert loop.pool.training_workers() == (0, 2, 3)
        assert loop.current_plan().train_workers == 3
        # The next step's timing is set beside the plan's prediction.
        loop.on_step(step(2, rollout_s=10, train_s=400, train_workers=3), heavy)
    (entry,) = loop.log.entries
    assert entry["step"] == 2 and entry["train_workers"] == 3
    assert entry["measured"]["train_s"] == 400 and "error" in entry


async def test_a_replan_not_worth_its_move_leaves_the_rule_to_decide() -> None:
    config = LoopConfig(trigger=ReplanTrigger(every_steps=1), move_cost_s=1e9)
    async with loop_over_pool(config) as loop:
        decision = loop.on_step(step(1, rollout_s=100, train_s=100), WORKLOAD)
        assert decision.action == "hold" and decision.reason == "balanced"
        assert loop.log.entries == [] and loop.pool.moves == []


async def test_it_decides_after_every_step_it_receives() -> None:
    send, receive = anyio.create_memory_object_stream[tuple[StepTiming, Demand]](4)
    async with loop_over_pool() as loop:
        async with send:
            await send.send((step(1, rollout_s=100, train_s=150), WORKLOAD))
            await send.send((step(2, rollout_s=100, train_s=150), WORKLOAD))
        await loop.run(receive)
        await loop.pool.settled()
    assert [(d.step, d.action) for d in loop.decisions] == [(1, "borrow"), (2, "hold")]


async def test_a_replan_that_borrows_waits_while_the_rollout_is_busy() -> None:
    heavy = Demand(512, output_tokens=(20, 30, 40), context_tokens=(60_000, 80_000, 100_000))
    async with loop_over_pool(LoopConfig(trigger=ReplanTrigger(every_steps=1))) as loop:
        routes = occupy(loop.pool.router, 11)
        decision = loop.on_step(step(1, rollout_s=10, train_s=10), heavy)
        assert decision.action == "hold"
        assert decision.reason == "schedule, queue pressure 0.92: the plan borrows under pressure"
        assert loop.pool.moves == [] and loop.log.entries == []
        for route in routes:
            loop.pool.router.release(route, outcome="ok")
