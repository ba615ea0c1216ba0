"""``libra bench engine``, briefly: every pair's runs answer every call, the bare client
replays exactly the engine's calls, and the medians are of the pairs."""

from __future__ import annotations

import statistics

import pytest

from libra.bench._docs_render import engine as engine_table
from libra.bench._engine import as_json, run_engine_bench


@pytest.mark.slow  # an emulated server in a subprocess, and a benchmark
@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the command runs on uvloop's
async def test_a_short_run_measures_each_pair_and_reports_their_medians() -> None:
    (result,) = await run_engine_bench((8,), min_trajectories=16, pairs=2)
    assert result.errors == 0 and result.bare_errors == 0
    assert result.trajectories == 16 and result.calls > result.trajectories  # multi-turn
    assert len(result.calls_ratio_per_pair) == len(result.cpu_ratio_per_pair) == 2
    assert all(ratio > 0 for ratio in result.calls_ratio_per_pair + result.cpu_ratio_per_pair)
    assert len(result.httptools_calls_ratio_per_pair) == 2
    assert min(result.bare_aiohttp_calls_s, result.bare_httptools_calls_s) > 0
    assert result.calls_s > 0 and result.bare_httpx_calls_s > 0
    table = engine_table([as_json([result])])
    median = statistics.median(result.calls_ratio_per_pair)
    assert f"{median:.2f} (" in table[-1]
