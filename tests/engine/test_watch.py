"""The stall warning: a rollout says so on stderr when no generation returns."""

from __future__ import annotations

import logging

import anyio
import pytest

from libra.emulation import LatencyModel
from libra.engine import (
    Engine,
    EngineConfig,
    TrajectoryRecord,
    http_transport,
    jobs_for,
    rollout,
)
from libra.envs import Env
from libra.fleet import Endpoint
from libra.sched.policies import LeastLoadedScheduler
from tests._helpers import MODEL, emulated_engine, hung_server

pytestmark = pytest.mark.anyio

STALLED = "no generation has returned for"


class Hello(Env):
    def reset(self, seed: int) -> str:
        return "Say hello."

    def reward(self, answer: str) -> float:
        return float("hello" in answer.lower())


def stall_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "libra.engine" and r.levelno == logging.WARNING
    ]


async def test_a_rollout_on_a_hung_fleet_warns_once_per_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="libra.engine")
    config = EngineConfig(
        stall_warning_s=0.2, call_timeout_s=1.0, call_timeout_per_token_s=0.0, max_attempts=1
    )
    records: list[TrajectoryRecord] = []
    async with hung_server() as url, http_transport("httpx") as http:
        engine = Engine(http, LeastLoadedScheduler([Endpoint(url, model=MODEL)]), config=config)
        started = anyio.current_time()
        await rollout(jobs_for(Hello, "hello", 3), engine, on_record=records.append)
        elapsed = anyio.current_time() - started
    assert [(r.status, r.stop_reason) for r in records] == [("failed", "server_error")] * 3
    warnings = stall_warnings(caplog)
    assert warnings and all(STALLED in w and "3 calls in flight" in w for w in warnings)
    assert len(warnings) <= elapsed / 0.2  # at most one per interval


async def test_a_rollout_whose_generations_keep_returning_does_not_warn(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Calls in flight for a second and more, two at a time, each returning in about
    0.15 s: never quiet for the 0.5 s the warning waits (checked every 0.125 s)."""
    caplog.set_level(logging.WARNING, logger="libra.engine")
    steady = LatencyModel(
        prefill_s_per_token=0.0, step_base_s=0.02, step_per_seq_s=0.0, step_per_ctx_token_s=0.0
    )
    config = EngineConfig(stall_warning_s=0.5, concurrency=2)
    async with emulated_engine(["Hello!"] * 16, config=config, latency=steady) as (engine, out):
        started = anyio.current_time()
        await rollout(jobs_for(Hello, "hello", 16), engine)
        elapsed = anyio.current_time() - started
    assert len(out) == 16 and elapsed > 1.0  # long enough for the watch to look, often
    assert not stall_warnings(caplog)
