"""The serving truth: off the planner's datasheet prior, and learnable from its calls."""

from __future__ import annotations

from typing import Any

import anyio
import pytest
from trio.testing import MockClock

from libra.alloc import CallTiming, RolloutCost
from libra.bench._sched_fleet import load_fleet
from libra.emulation import BatchingEngine, ServingTruth

FLEET = load_fleet()
pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, Any]]:
    return "trio", {"clock": MockClock(autojump_threshold=0)}


async def test_the_truth_is_not_the_datasheet_prior() -> None:
    truth = ServingTruth()
    for tp in (1, 2, 4):
        prior = FLEET.roofline.step_cost(tp)
        real = truth.latency(FLEET.gpu, FLEET.model, tp)
        for term in ("prefill_s_per_token", "step_base_s", "step_per_seq_s"):
            assert getattr(real, term) > 1.15 * getattr(prior, term), (tp, term)
        assert real.prefill_interference > 0 and real.jitter > 0
    assert truth.tp_speedup(1) == 1.0 and 1.0 < truth.tp_speedup(4) < 4.0
    assert truth.sync_s(FLEET.model) > 0 and truth.start_s > truth.reload_s > 0


async def _calls(tp: int, batches: list[tuple[int, int, int]], seed: int) -> list[CallTiming]:
    """Calls of ``(concurrent, prompt, new)`` batches on a TP``tp`` instance of the truth."""
    engine = BatchingEngine(ServingTruth().latency(FLEET.gpu, FLEET.model, tp), seed=seed)
    found: list[CallTiming] = []

    async def call(prompt: int, new: int, concurrent: int) -> None:
        sent = anyio.current_time()
        produced = await engine.generate(prompt, new)
        seconds = anyio.current_time() - sent
        found.append(CallTiming("i", tp, prompt, 0, produced, seconds, concurrent))

    for concurrent, prompt, new in batches:
        async with anyio.create_task_group() as group:
            for _ in range(concurrent):
                group.start_soon(call, prompt, new, concurrent)
    return found


def _worst_error(cost: RolloutCost, calls: list[CallTiming]) -> float:
    return max(abs(cost.predict_call(call) / call.seconds - 1) for call in calls)


async def test_a_planner_fed_the_truths_calls_predicts_them_within_15_percent() -> None:
    # Batches the KV cache holds at once: queueing is the scheduler's part, not the cost's.
    training = [(c, p, n) for c in (1, 8, 32) for p in (500, 4000) for n in (200, 1500)]
    held_out = [(4, 2000, 800), (16, 1000, 400), (48, 3000, 600)]
    for tp in (1, 4):
        cost = RolloutCost(FLEET.roofline)
        fresh = await _calls(tp, held_out, seed=2)
        before = _worst_error(cost, fresh)
        for timing in await _calls(tp, training, seed=1):
            cost.observe(timing)
        after = _worst_error(cost, fresh)
        assert before > 0.15, (tp, before)  # the prior alone is off by more than that
        assert after < 0.15, (tp, after)
