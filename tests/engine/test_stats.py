"""A rollout's live counters agree with the records they count."""

from __future__ import annotations

import pytest

from envs_contrib.calc import Calc
from libra.engine import jobs_for, rollout
from tests._helpers import emulated_engine

pytestmark = pytest.mark.anyio


async def test_the_counters_sum_up_the_records() -> None:
    async with emulated_engine() as (engine, records):
        stats = await rollout(jobs_for(Calc, "calc", 16, seed=2), engine)
    assert stats.done == len(records) == 16
    assert stats.turns == sum(r.turns for r in records)
    assert stats.tool_calls == sum(len(r.tool_returns) for r in records)
    assert stats.sampled_tokens == sum(sum(r.loss_mask) for r in records) > 0
