"""Rollouts: many trajectories, one record each, whatever goes wrong."""

from __future__ import annotations

import socket
from collections import Counter
from collections.abc import Mapping

import anyio
import pytest

from envs_contrib.calc import Calc
from envs_contrib.guess import Guess
from libra.bench._engine import _Recording
from libra.emulation import AgentScript, EmulatorConfig, LatencyModel, running_emulator
from libra.engine import (
    Engine,
    EngineConfig,
    SamplingConfig,
    TrajectoryRecord,
    http_transport,
    jobs_for,
    rollout,
)
from libra.fleet import Endpoint
from libra.sched.policies import LeastLoadedScheduler
from tests._helpers import MODEL, assert_tokens_consistent, emulated_engine

pytestmark = pytest.mark.anyio


def check_one_record_each(records: list[TrajectoryRecord], n: int) -> None:
    assert len(records) == n
    assert len({r.id for r in records}) == n
    assert all(r.status in ("completed", "truncated", "failed") for r in records)


async def test_calc_rollout_of_64_is_exact_and_complete() -> None:
    async with emulated_engine(config=EngineConfig(concurrency=16)) as (engine, records):
        stats = await rollout(jobs_for(Calc, "calc", 64, seed=1), engine)
    check_one_record_each(records, 64)
    assert stats.done == 64 and sum(stats.statuses.values()) == 64
    assert all(r.tokens == "exact" and r.token_ids for r in records)
    for record in records:
        assert_tokens_consistent(record, Calc.tool_schemas())
    assert any(r.tool_returns for r in records)


class _SlowRecording(_Recording):
    """Every request takes a moment, as over a network, so concurrent first turns overlap."""

    async def post(
        self, url: str, body: bytes, headers: Mapping[str, str], timeout_s: float
    ) -> tuple[int, bytes]:
        await anyio.sleep(0.001)
        return await super().post(url, body, headers, timeout_s)


async def test_concurrent_first_turns_share_one_probe_of_the_server() -> None:
    async with emulated_engine(api="chat", config=EngineConfig(concurrency=32)) as (
        engine,
        records,
    ):
        engine.client.http = recording = _SlowRecording(engine.client.http)
        await rollout(jobs_for(Calc, "calc", 32), engine)
    check_one_record_each(records, 32)
    # All 32 first turns ask at once whether the template renders tools: one probe (two
    # renderings) answers them all.
    assert [path for path, _ in recording.sent].count("/tokenize") == 2


async def test_samples_per_prompt_share_the_task() -> None:
    jobs = jobs_for(Guess, "guess", 8, samples_per_prompt=4, seed=3)
    assert [j.sample for j in jobs] == [0, 1, 2, 3] * 2
    assert len({j.task_id for j in jobs}) == 2


@pytest.mark.faults
async def test_garbage_heavy_model_still_ends_every_trajectory() -> None:
    agent = AgentScript(garbage_rate=0.6)
    config = EngineConfig(sampling=SamplingConfig(seed=7))  # so samples of one prompt differ
    async with emulated_engine(agent=agent, config=config) as (engine, records):
        await rollout(jobs_for(Guess, "guess", 40, seed=2), engine)
    check_one_record_each(records, 40)
    failures = [t for r in records for t in r.tool_returns if t.status == "failure"]
    assert failures, "garbage calls should come back to the model as failed tool returns"


@pytest.mark.faults
async def test_injected_server_errors_are_retried() -> None:
    config = EngineConfig(max_attempts=8, retry_backoff_s=0.0)
    async with emulated_engine(config=config, error_rate=0.3) as (engine, records):
        await rollout(jobs_for(Calc, "calc", 30), engine)
    check_one_record_each(records, 30)
    assert Counter(r.status for r in records)["failed"] == 0


@pytest.mark.faults
async def test_garbage_bodies_stalls_and_aborts_from_the_server_never_reach_the_record() -> None:
    """Each is retried (a garbage body, a stalled call cut at its timeout) or continued (an
    abort): every trajectory ends once, with exact tokens, and none is the model's failure."""
    config = EngineConfig(
        concurrency=16, max_attempts=12, retry_backoff_s=0.0, call_timeout_s=0.3,
        call_timeout_per_token_s=0.0,
    )  # fmt: skip
    async with emulated_engine(
        api="tokens", config=config, garbage_rate=0.15, stall_rate=0.05, abort_rate=0.15
    ) as (engine, records):
        await rollout(jobs_for(Calc, "calc", 24, seed=4), engine)
        last_failure = engine.generations.last_failure
    check_one_record_each(records, 24)
    assert last_failure  # faults were injected, and retried
    for record in records:
        assert (record.status, record.stop_reason) == ("completed", "model_stop"), record.error
        assert_tokens_consistent(record, Calc.tool_schemas())


class FinishLog(LeastLoadedScheduler):
    """Least-loaded routing that notes which trajectories it was told ended, and how."""

    def __init__(self, endpoints: list[Endpoint]) -> None:
        super().__init__(endpoints)
        self.failed: dict[str, bool] = {}

    def on_finish(
        self, trajectory_id: str, prompt_id: str, *, output_tokens: int, failed: bool = False
    ) -> None:
        self.failed[trajectory_id] = failed


@pytest.mark.faults
async def test_cancelling_a_rollout_records_every_trajectory() -> None:
    slow = LatencyModel(prefill_s_per_token=0.0, step_base_s=0.002)
    async with emulated_engine(latency=slow, config=EngineConfig(concurrency=8)) as (
        engine,
        records,
    ):
        engine.scheduler = scheduler = FinishLog(list(engine.scheduler.router.endpoints().values()))
        with anyio.move_on_after(0.5):
            await rollout(jobs_for(Guess, "guess", 200), engine)
    check_one_record_each(records, len(records))
    statuses = Counter(r.stop_reason for r in records)
    assert statuses["cancelled"] >= 1  # the ones in flight when cancelled
    assert len(records) < 200  # the ones never started are not recorded: they never entered
    # The scheduler forgets every trajectory, and learns no length from a cancelled one.
    assert scheduler.failed == {r.id: r.status == "failed" for r in records}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # aiohttp is asyncio-only
async def test_rollout_over_a_real_port() -> None:
    config = EmulatorConfig(latency=LatencyModel.zero())
    with running_emulator(config) as url:
        async with http_transport() as http:
            records: list[TrajectoryRecord] = []
            engine = Engine(
                http,
                LeastLoadedScheduler([Endpoint(url, model=MODEL)]),
                on_record=records.append,
            )
            await rollout(jobs_for(Calc, "calc", 16), engine)
    check_one_record_each(records, 16)
    assert all(r.status != "failed" for r in records)
    for record in records:
        assert_tokens_consistent(record, Calc.tool_schemas())


@pytest.mark.faults
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_dead_server_fails_trajectories_and_a_live_one_takes_over() -> None:
    dead = Endpoint(f"http://127.0.0.1:{free_port()}", model=MODEL, name="dead")
    config = EngineConfig(max_attempts=3, retry_backoff_s=0.01)
    with running_emulator(EmulatorConfig(latency=LatencyModel.zero())) as url:
        async with http_transport() as http:
            alone: list[TrajectoryRecord] = []
            engine = Engine(
                http,
                LeastLoadedScheduler([dead]),
                config=config,
                on_record=alone.append,
            )
            await rollout(jobs_for(Calc, "calc", 4), engine)

            both: list[TrajectoryRecord] = []
            live = Endpoint(url, model=MODEL, name="live")
            scheduler = LeastLoadedScheduler([dead, live])
            engine = Engine(http, scheduler, config=config, on_record=both.append)
            await rollout(jobs_for(Calc, "calc", 8), engine)
    assert [(r.status, r.stop_reason) for r in alone] == [("failed", "server_error")] * 4
    assert all(r.error and "dead" in r.error for r in alone)
    assert all(r.status != "failed" for r in both)
    assert all(set(r.endpoints) == {"live"} for r in both)
    assert scheduler.calls_in_flight() == {"dead": 0, "live": 0}
