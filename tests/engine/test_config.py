"""The engine's limits come from its config alone: the request timeout included."""

from __future__ import annotations

import pytest

from libra.emulation import EmulatorConfig, LatencyModel, ScriptedReplies, create_app
from libra.engine import ASGITransport, Engine, EngineConfig, TrajectoryJob, run_trajectory
from libra.envs import Env
from libra.fleet import Endpoint
from libra.sched.policies import LeastLoadedScheduler
from tests._helpers import EMULATED_URL, MODEL

pytestmark = pytest.mark.anyio

# Every decode step takes 0.1 s: a reply of a few tokens takes a few tenths of a second.
SLOW = LatencyModel(
    prefill_s_per_token=0.0,
    step_base_s=0.1,
    step_per_seq_s=0.0,
    step_per_ctx_token_s=0.0,
    max_num_seqs=8,
    kv_capacity_tokens=100_000,
)


class Answer(Env):
    def reset(self, seed: int) -> str:
        return "Say hi."

    def reward(self, answer: str) -> float:
        return 1.0


async def answer_with_timeout(request_timeout_s: float) -> tuple[str, str, str | None]:
    app = create_app(EmulatorConfig(latency=SLOW), ScriptedReplies(["hi"]))
    config = EngineConfig(request_timeout_s=request_timeout_s, max_attempts=1)
    async with ASGITransport(app) as http:
        scheduler = LeastLoadedScheduler([Endpoint(EMULATED_URL, model=MODEL, api="chat")])
        engine = Engine(http, scheduler, config=config)
        assert engine.client.timeout_s == request_timeout_s
        record = await run_trajectory(TrajectoryJob.seeded(Answer, "answer", 0), engine)
    return record.status, record.stop_reason, record.error


async def test_a_call_slower_than_the_configured_request_timeout_fails() -> None:
    status, reason, error = await answer_with_timeout(0.05)
    assert (status, reason) == ("failed", "server_error")
    assert error is not None and "no answer within 0.05 s" in error


async def test_a_call_within_the_configured_request_timeout_completes() -> None:
    assert await answer_with_timeout(30.0) == ("completed", "model_stop", None)
