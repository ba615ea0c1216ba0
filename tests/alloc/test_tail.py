"""Lending the rollout's tail: how many hybrid units the rule borrows from what the run
observes, and the borrowed unit joining a training step under way, in virtual time."""

from __future__ import annotations

from typing import Any

import anyio
import pytest
from trio.testing import MockClock

from libra.alloc import (
    HybridPool,
    TailLender,
    TailRule,
    borrow_pays,
    lend_tail,
    start_layout,
    tail_borrow,
    timed_restart_s,
)
from libra.sched import Router
from tests._helpers import POOL_CONFIG, POOL_LAYOUT, emulated_cluster

pytestmark = pytest.mark.anyio

RULE = TailRule(trajectories_per_instance=2, min_train_left_s=30, poll_s=1)


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, Any]]:
    """Trio with a clock that jumps whenever every task sleeps: virtual time."""
    return "trio", {"clock": MockClock(autojump_threshold=0)}


async def test_the_rule_keeps_what_the_unfinished_trajectories_need() -> None:
    cluster = emulated_cluster()
    fleet = await start_layout(cluster, POOL_LAYOUT, POOL_CONFIG)
    async with HybridPool(cluster, Router(fleet), POOL_LAYOUT, POOL_CONFIG) as pool:
        assert tail_borrow(pool, RULE, unfinished=6, train_left_s=100) == 0  # 3 needed
        assert tail_borrow(pool, RULE, unfinished=3, train_left_s=100) == 1
        assert tail_borrow(pool, RULE, unfinished=0, train_left_s=100) == 2
        assert tail_borrow(pool, RULE, unfinished=0, train_left_s=10) == 0  # not worth it


async def test_a_borrow_is_made_only_where_training_saves_more_than_the_restart_costs() -> None:
    """One worker trains and three serve: lending both hybrid units saves 2/3 of what
    training has left and costs the next rollout 2/3 of a restart (90 s), one unit
    1/2 and 1/3."""
    assert borrow_pays(100, training=1, lent=2, serving=3, restart_s=90)  # 66.7 s, 60 s
    assert not borrow_pays(80, training=1, lent=2, serving=3, restart_s=90)  # 53.3 s, 60 s
    cluster = emulated_cluster()
    fleet = await start_layout(cluster, POOL_LAYOUT, POOL_CONFIG)
    async with HybridPool(cluster, Router(fleet), POOL_LAYOUT, POOL_CONFIG) as pool:
        assert tail_borrow(pool, RULE, unfinished=0, train_left_s=100) == 2
        assert tail_borrow(pool, RULE, unfinished=0, train_left_s=80) == 1  # 40 s, 30 s
        assert tail_borrow(pool, RULE, unfinished=0, train_left_s=50) == 0  # 25 s, 30 s
        free = RULE.model_copy(update={"restart_s": 0.0})
        assert tail_borrow(pool, free, unfinished=0, train_left_s=50) == 2


async def test_a_borrowed_unit_joins_the_step_under_way_and_shortens_it() -> None:
    cluster = emulated_cluster()
    trainer = cluster.trainer
    fleet = await start_layout(cluster, POOL_LAYOUT, POOL_CONFIG)
    alone = trainer.step_seconds(2_000_000, 1)
    done = anyio.Event()
    took = 0.0

    async def train() -> None:
        nonlocal took
        took = await trainer.step(2_000_000)
        done.set()

    async with HybridPool(cluster, Router(fleet), POOL_LAYOUT, POOL_CONFIG) as pool:
        started = anyio.current_time()
        async with anyio.create_task_group() as group:
            group.start_soon(train)
            group.start_soon(
                lend_tail, pool, RULE, lambda: 1, lambda: alone - anyio.current_time() + started,
                done,
            )  # fmt: skip
        # One instance serves the last trajectory; both hybrid units train.
        assert [pool.path_of(w)[-1] for w in (1, 2, 3)] == ["serving", "active", "active"]
        assert trainer.active == {0, 2, 3}
    assert took < alone


async def test_the_lender_gives_back_at_the_next_rollout_what_it_lent_in_a_step() -> None:
    cluster = emulated_cluster()
    trainer = cluster.trainer
    fleet = await start_layout(cluster, POOL_LAYOUT, POOL_CONFIG)
    alone = trainer.step_seconds(2_000_000, 1)
    async with HybridPool(cluster, Router(fleet), POOL_LAYOUT, POOL_CONFIG) as pool:
        lender = TailLender(pool, RULE)
        started = anyio.current_time()
        async with lender.lending(lambda: 0, lambda: alone - anyio.current_time() + started):
            took = await trainer.step(2_000_000)
        assert lender.last == lender.lent == ["w2", "w3"]
        # Priced as the core alone would have taken it (183 s, not the 65 s it took):
        # within 5% (the emulated trainer's all-gathers grow with its workers).
        assert abs(lender.alone_s(took) - alone) < 0.05 * alone
        assert trainer.active == {0, 2, 3}
        released = lender.give_back()  # the next rollout starts
        assert sorted(move.unit for move in released) == ["w2", "w3"] and lender.lent == []
        await pool.settled()
        assert [pool.path_of(w)[-1] for w in (1, 2, 3)] == ["serving"] * 3
        assert trainer.active == {0}
        assert [m.outcome for m in pool.moves] == ["done"] * 4
        # The release it timed, not the rule's prior, prices the next borrow: the
        # emulated servers start in 20 s.
        assert 20 <= timed_restart_s(pool, RULE) < RULE.restart_s


async def test_each_step_s_training_is_lent_to_at_the_last_step_s_price_alone() -> None:
    """``TailLender.training`` around each step (what the RL loop calls through the
    allocation): step 0 sets the price and lends nothing; step 1 lends both units; step
    2, priced as the core alone would have taken step 1 (not at its shortened seconds),
    lends them again."""
    cluster = emulated_cluster()
    trainer = cluster.trainer
    fleet = await start_layout(cluster, POOL_LAYOUT, POOL_CONFIG)
    positions = 2_000_000
    alone = trainer.step_seconds(positions, 1)
    async with HybridPool(cluster, Router(fleet), POOL_LAYOUT, POOL_CONFIG) as pool:
        lender = TailLender(pool, RULE)
        lent: list[list[str]] = []
        took: list[float] = []
        for _ in range(3):
            lender.give_back()  # the step's rollout
            await pool.settled()
            started = anyio.current_time()
            async with lender.training(lambda: positions, lambda: 0):
                await trainer.step(positions)
            lent.append(list(lender.last))
            took.append(anyio.current_time() - started)
        assert lent == [[], ["w2", "w3"], ["w2", "w3"]]
        assert took[0] > alone * 0.99 and took[1] < alone / 2 and took[2] < alone / 2


async def test_a_unit_still_on_its_way_to_training_is_given_back_once_it_arrives() -> None:
    cluster = emulated_cluster()
    fleet = await start_layout(cluster, POOL_LAYOUT, POOL_CONFIG)
    async with HybridPool(cluster, Router(fleet), POOL_LAYOUT, POOL_CONFIG) as pool:
        lender = TailLender(pool, RULE)
        # Four trajectories left: two instances keep them, one unit is lent; training
        # ends before its join does.
        async with lender.lending(lambda: 4, lambda: 100.0):
            await anyio.sleep(RULE.poll_s / 2)
        assert lender.last == ["w3"] and pool.pending()
        assert lender.give_back() == [] and lender.lent == ["w3"]
        await pool.settled()
        assert pool.path_of(3)[-1] == "active"  # it trains the next step meanwhile
        [move] = lender.give_back()
        assert (move.unit, move.direction) == ("w3", "release") and lender.lent == []
        await pool.settled()
        assert pool.path_of(3)[-1] == "serving"


async def test_a_step_units_leave_as_it_runs_is_priced_as_the_core_alone_would_take_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """In one-step-off a released unit trains pieces of the step under way before it
    leaves: that step is priced as the workers that stay would take it alone (here the
    leaves come 30 s into the step)."""
    cluster = emulated_cluster()
    trainer = cluster.trainer
    fleet = await start_layout(cluster, POOL_LAYOUT, POOL_CONFIG)
    alone = trainer.step_seconds(2_000_000, 1)

    async def leave_late(worker: int) -> None:
        await anyio.sleep(30)
        await trainer.leave(worker)

    async with HybridPool(cluster, Router(fleet), POOL_LAYOUT, POOL_CONFIG) as pool:
        lender = TailLender(pool, RULE)
        async with lender.lending(lambda: 0, lambda: alone):
            await trainer.step(2_000_000)
        monkeypatch.setattr(cluster, "leave_training", leave_late)
        assert len(lender.give_back()) == 2  # the next rollout starts: both go back
        async with lender.lending(lambda: 100, lambda: 0.0):  # nothing more is lent
            took = await trainer.step(2_000_000)
        assert lender.last == [] and 30 < took < alone
        assert abs(lender.alone_s(took) - alone) < 0.05 * alone
