"""The elastic hybrid pool on the emulated cluster, in virtual time: a join through its five
states, a failed and a hung join returning the worker to rollout, a failed start returning
it to training, moves that block neither stage, and a drained move during a real rollout
that loses no trajectory."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import httpx
import pytest
from trio.testing import MockClock

from envs_contrib.calc import Calc
from libra.alloc import JOIN_STATES, HybridPool, Layout, PoolConfig, start_layout
from libra.emulation import EmulatedCluster, TrainTruth
from libra.engine import (
    ASGITransport,
    Engine,
    EngineConfig,
    TrajectoryRecord,
    jobs_for,
    rollout,
)
from libra.fleet import FleetSpec
from libra.sched import Router
from libra.sched.policies import make_policy
from tests._helpers import (
    MODEL,
    POOL_CONFIG,
    POOL_LAYOUT,
    SMALL_MODEL,
    assert_tokens_consistent,
    emulated_cluster,
)

pytestmark = pytest.mark.anyio

LEAVE_ROLLOUT = ["serving", "draining", "stopping"]
BACK_TO_ROLLOUT = ["leaving", "starting", "serving"]


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, Any]]:
    """Trio with a clock that jumps whenever every task sleeps: virtual time."""
    return "trio", {"clock": MockClock(autojump_threshold=0)}


@asynccontextmanager
async def pool_on(
    cluster: EmulatedCluster, config: PoolConfig = POOL_CONFIG
) -> AsyncIterator[HybridPool]:
    fleet = await start_layout(cluster, POOL_LAYOUT, config)
    async with HybridPool(cluster, Router(fleet), POOL_LAYOUT, config) as pool:
        yield pool


async def answers(cluster: EmulatedCluster, name: str) -> bool:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=cluster.fleet)) as client:
        return (await client.get(f"http://{name}/v1/models")).status_code == 200


def fetch_seconds(cluster: EmulatedCluster) -> float:
    truth = cluster.trainer.truth
    return SMALL_MODEL.parameters * truth.state_bytes_per_param / truth.link_bytes_per_s


async def test_a_borrowed_worker_joins_through_the_five_states_and_comes_back() -> None:
    cluster = emulated_cluster(start_s=20.0)
    async with pool_on(cluster) as pool:
        assert cluster.trainer.active == {0}
        (move,) = pool.borrow(1)
        assert move.unit == "w3" and pool.state[3] == "serving"  # borrow returned at once
        await pool.settled()
        assert move.outcome == "done"
        assert pool.path_of(3) == [*LEAVE_ROLLOUT, *JOIN_STATES]
        assert cluster.trainer.active == {0, 3} and pool.training_workers() == (0, 3)
        assert "w3" not in pool.router.by_name and "w3" not in cluster.fleet.apps
        times = {t.state: t.at for t in pool.history if t.worker == 3}
        truth = cluster.trainer.truth
        assert times["zero_sync"] - times["fetching_state"] == pytest.approx(fetch_seconds(cluster))
        assert times["activating"] - times["zero_sync"] == pytest.approx(truth.zero_sync_s)
        assert times["active"] - times["activating"] == pytest.approx(truth.activate_s)

        for endpoint in pool.router.endpoints().values():
            endpoint.weight_version = 5  # weights synced while it trained
        (back,) = pool.release(1)
        await pool.settled()
        assert pool.router.by_name["w3"].endpoint.weight_version == 5  # it loaded them
        assert back.outcome == "done" and back.ended is not None
        assert back.ended - back.started == pytest.approx(20.0)  # the instance's start
        assert pool.path_of(3)[-3:] == BACK_TO_ROLLOUT
        assert cluster.trainer.active == {0} and pool.router.by_name["w3"].state == "active"
        assert await answers(cluster, "w3")
    assert pool.path_of(2) == ["serving"]  # the other hybrid worker never moved
    now = anyio.current_time()
    spans = [(state, end - start) for worker, state, start, end in pool.spans(now) if worker == 3]
    assert [state for state, _ in spans] == pool.path_of(3)
    assert dict(spans)["fetching_state"] == pytest.approx(fetch_seconds(cluster))
    assert dict(spans)["starting"] == pytest.approx(20.0)


async def test_a_failed_join_returns_the_worker_to_rollout() -> None:
    cluster = emulated_cluster()
    cluster.fail_next_join(3)
    async with pool_on(cluster) as pool:
        (move,) = pool.borrow(1)
        await pool.settled()
    assert move.outcome == "returned" and "TrainJoinFailed" in move.error
    assert pool.path_of(3) == [*LEAVE_ROLLOUT, "requested", "fetching_state", *BACK_TO_ROLLOUT]
    assert pool.router.by_name["w3"].state == "active" and await answers(cluster, "w3")
    assert cluster.trainer.active == {0} and pool.workers_in("training") == 1


async def test_a_hung_join_times_out_and_returns_the_worker_to_rollout() -> None:
    cluster = emulated_cluster(start_s=20.0)
    cluster.hang_next_join(3)
    config = POOL_CONFIG.model_copy(update={"fetch_timeout_s": 90.0})
    async with pool_on(cluster, config) as pool:
        (move,) = pool.borrow(1)
        await pool.settled()
    assert move.outcome == "returned" and "fetching_state took over 90 s" in move.error
    assert move.ended is not None and move.ended - move.started == pytest.approx(90.0 + 20.0)
    assert pool.path_of(3)[-4:] == ["fetching_state", *BACK_TO_ROLLOUT]
    assert pool.router.by_name["w3"].state == "active" and await answers(cluster, "w3")
    assert cluster.trainer.active == {0}


async def test_a_failed_start_returns_the_worker_to_training() -> None:
    cluster = emulated_cluster()
    config = POOL_CONFIG.model_copy(update={"start_attempts": 1})
    async with pool_on(cluster, config) as pool:
        pool.borrow(1)
        await pool.settled()
        cluster.fail_next_start(3)
        (move,) = pool.release(1)
        await pool.settled()
    assert move.outcome == "returned" and "InstanceStartFailed" in move.error
    assert pool.path_of(3)[-7:] == ["leaving", "starting", *JOIN_STATES]
    assert cluster.trainer.active == {0, 3} and "w3" not in pool.router.by_name


async def test_a_worker_whose_way_back_fails_too_is_lost_and_left_alone() -> None:
    cluster = emulated_cluster()
    config = POOL_CONFIG.model_copy(update={"start_attempts": 1})
    async with pool_on(cluster, config) as pool:
        cluster.fail_next_join(3)
        cluster.fail_next_start(3)
        (move,) = pool.borrow(1)
        await pool.settled()
        assert move.outcome == "lost" and pool.state[3] == "lost"
        assert "w3" not in pool.router.by_name and cluster.placement.keys() == {"w1", "w2"}
        assert [m.unit for m in pool.borrow(1)] == ["w2"]  # never the lost one again
        assert pool.release(2) == []  # w2 is moving, w3 is lost
        await pool.settled()
    assert pool.training_workers() == (0, 2)


async def test_a_start_that_fails_once_is_tried_again() -> None:
    cluster = emulated_cluster(start_s=20.0)
    async with pool_on(cluster) as pool:
        pool.borrow(1)
        await pool.settled()
        cluster.fail_next_start(3)
        (move,) = pool.release(1)
        await pool.settled()
    assert move.outcome == "done" and move.ended is not None
    assert move.ended - move.started == pytest.approx(2 * 20.0)
    assert pool.path_of(3)[-3:] == ["starting", "starting", "serving"]
    assert any(t.note.startswith("start failed") for t in pool.history if t.worker == 3)


async def test_moves_block_neither_a_training_step_nor_each_other() -> None:
    cluster = emulated_cluster(start_s=20.0)
    trainer = cluster.trainer
    async with pool_on(cluster) as pool:
        moves = pool.borrow(2)
        assert [move.unit for move in moves] == ["w2", "w3"]
        assert pool.borrow(1) == []  # the last serving unit is a core one: nothing to move
        started = anyio.current_time()
        alone = trainer.step_seconds(200_000, 1)
        seconds = await trainer.step(200_000)  # on worker 0, while 2 and 3 join
        assert anyio.current_time() - started == pytest.approx(seconds)
        # The joins ended while the step ran, and the joiners took a share of what was left.
        assert all(m.ended is not None and m.ended < started + seconds for m in moves)
        assert seconds < alone
    assert [move.outcome for move in moves] == ["done", "done"]
    assert trainer.active == {0, 2, 3} and [i.name for i in pool.router.instances] == ["w1"]


async def test_the_rollout_keeps_its_last_instance() -> None:
    cluster = emulated_cluster()
    layout = Layout(training=(0,), hybrid=((1,), (2,), (3,)))
    fleet = await start_layout(cluster, layout, POOL_CONFIG)
    async with HybridPool(cluster, Router(fleet), layout, POOL_CONFIG) as pool:
        assert [move.unit for move in pool.borrow(5)] == ["w2", "w3"]
        await pool.settled()
    assert [i.name for i in pool.router.instances] == ["w1"]


# ------------------------------------------------------------ a move during a real rollout


def check_every_job_once(records: list[TrajectoryRecord], n: int) -> None:
    assert len(records) == n and len({r.id for r in records}) == n
    for record in records:
        assert record.status != "failed", (record.stop_reason, record.error)
        assert record.tokens == "exact"
        assert_tokens_consistent(record, Calc.tool_schemas())
        replies = sum(m.role == "assistant" for m in record.messages)
        assert replies == record.turns == len(record.endpoints)  # no turn lost or doubled


async def rollout_with_a_borrow(
    cluster: EmulatedCluster, fleet: FleetSpec, config: PoolConfig, jobs: int
) -> tuple[HybridPool, list[TrajectoryRecord], int]:
    """Roll ``jobs`` out while worker 3's instance leaves for training mid-rollout; also
    the calls it had in flight when it began to drain."""
    policy = make_policy("cmlfq", fleet)
    records: list[TrajectoryRecord] = []
    engine_config = EngineConfig(concurrency=jobs, retry_backoff_s=0.05)
    async with ASGITransport(cluster.fleet) as http:
        engine = Engine(http, policy, config=engine_config, on_record=records.append)
        async with HybridPool(cluster, policy.router, POOL_LAYOUT, config) as pool:
            w3 = policy.router.by_name["w3"]
            async with anyio.create_task_group() as group:
                group.start_soon(rollout, jobs_for(Calc, "calc", jobs), engine)
                await anyio.sleep(1.0)  # a few turns in: calls run on every instance
                in_flight = w3.in_flight
                pool.borrow(1)
                await pool.settled()
                assert len(records) < jobs  # it all happened mid-rollout
    return pool, records, in_flight


async def test_a_drained_move_during_a_rollout_loses_no_trajectory() -> None:
    cluster = emulated_cluster(start_s=20.0)
    fleet = await start_layout(cluster, POOL_LAYOUT, POOL_CONFIG)
    pool, records, in_flight = await rollout_with_a_borrow(cluster, fleet, POOL_CONFIG, 32)
    assert in_flight > 0
    (move,) = pool.moves
    assert move.outcome == "done" and cluster.trainer.active == {0, 3}
    assert not any("cut" in t.note for t in pool.history)  # drained in time
    check_every_job_once(records, 32)
    assert any("w3" in r.endpoints and r.endpoints[-1] != "w3" for r in records)


async def test_a_drain_that_times_out_cuts_the_calls_and_they_go_on_elsewhere() -> None:
    cluster = emulated_cluster(start_s=20.0)
    fleet = await start_layout(cluster, POOL_LAYOUT, POOL_CONFIG)
    config = POOL_CONFIG.model_copy(update={"drain_timeout_s": 0.01})
    pool, records, in_flight = await rollout_with_a_borrow(cluster, fleet, config, 32)
    assert in_flight > 0
    assert any(t.note == "drain timed out: calls cut" for t in pool.history if t.worker == 3)
    # It left 0.01 s after the drain began, long before its calls (0.4 s or more) ended.
    (move,) = pool.moves
    truth = cluster.trainer.truth
    join_s = fetch_seconds(cluster) + truth.zero_sync_s + truth.activate_s
    assert move.ended is not None and move.ended - move.started == pytest.approx(0.01 + join_s)
    check_every_job_once(records, 32)
    assert cluster.trainer.active == {0, 3} and fleet.instances[0].model == MODEL


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the pool is anyio: not trio-bound
async def test_a_round_trip_in_real_time_on_asyncio() -> None:
    cluster = emulated_cluster(start_s=0.01)
    cluster.trainer.truth = TrainTruth(
        jitter=0.0, link_bytes_per_s=1e12, zero_sync_s=0.01, activate_s=0.01
    )
    async with pool_on(cluster) as pool:
        with anyio.fail_after(10):
            (borrowed,) = pool.borrow(1)
            await borrowed.finished.wait()
            (released,) = pool.release(1)
            await released.finished.wait()
    assert (borrowed.outcome, released.outcome) == ("done", "done")
    assert pool.path_of(3) == [*LEAVE_ROLLOUT, *JOIN_STATES, *BACK_TO_ROLLOUT]
    assert await answers(cluster, "w3")


async def test_a_layout_uses_each_worker_once_and_moves_need_the_pool_entered() -> None:
    cluster = emulated_cluster()
    with pytest.raises(ValueError, match="at most once"):
        await start_layout(cluster, Layout(training=(0,), hybrid=((0, 1),)), POOL_CONFIG)
    with pytest.raises(ValueError, match="at most once"):
        Layout(training=(0, 7), rollout=((1,),)).check(cluster.workers)
    fleet = await start_layout(cluster, POOL_LAYOUT, POOL_CONFIG)
    pool = HybridPool(cluster, Router(fleet), POOL_LAYOUT, POOL_CONFIG)
    with pytest.raises(RuntimeError, match="async with"):
        pool.borrow(1)
    assert pool.moves == [] and pool.state == {
        0: "active",
        1: "serving",
        2: "serving",
        3: "serving",
    }
