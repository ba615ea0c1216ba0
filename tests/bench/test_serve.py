"""``libra bench serve``, briefly: both paths answer every request in every pair and the
figures are filled in."""

from __future__ import annotations

import math

import pytest

from libra.bench._serve import as_json, bench_serve


@pytest.mark.slow  # two servers in subprocesses, and a benchmark
def test_a_short_run_measures_both_paths_at_each_level() -> None:
    results = bench_serve([1, 4], seconds=0.3, pairs=2)
    assert [r.concurrency for r in results] == [1, 4]
    for result in results:
        assert result.pairs == 2 and len(result.added_p50_ms_per_pair) == 2
        for path in (result.direct, result.gateway):
            assert path.requests > 1 and path.errors == 0 and path.requests_s > 0
            assert 0 < path.p50_ms <= path.p99_ms
            assert math.isnan(path.server_cpu_us) or path.server_cpu_us > 0
    report = as_json(results)
    assert report["gateway_max_requests_s"] == max(r.gateway.requests_s for r in results)
    assert {"added_p50_ms", "added_p99_ms"} <= set(report["levels"][0])
