"""vLLM's /metrics: parsed, and polled into the router."""

from __future__ import annotations

from typing import Any

import pytest

from libra.emulation import EmulatorConfig, LatencyModel, create_app
from libra.engine._asgi import ASGITransport
from libra.fleet import FleetSpec, InstanceSpec
from libra.sched import Router, parse_metrics, poll_once


def test_prometheus_text_is_parsed_and_label_sets_are_summed() -> None:
    text = (
        "# TYPE vllm:num_requests_waiting gauge\n"
        'vllm:num_requests_waiting{model_name="m",engine="0"} 3.0\n'
        'vllm:num_requests_waiting{model_name="m",engine="1"} 2.0\n'
        "vllm:kv_cache_usage_perc 0.5\n"
        "broken_line nan-ish\n"
    )
    values = parse_metrics(text)
    assert values["vllm:num_requests_waiting"] == 5.0
    assert values["vllm:kv_cache_usage_perc"] == 0.5
    assert "broken_line" not in values


@pytest.mark.anyio
async def test_polling_reads_vllm_gauges_and_marks_silent_servers() -> None:
    spec = FleetSpec(
        instances=[
            InstanceSpec(name="up", url="http://up", max_num_seqs=8),
            InstanceSpec(name="gone", url="http://gone", max_num_seqs=8),
        ]
    )
    router = Router(spec)
    app = create_app(EmulatorConfig(latency=LatencyModel()))

    async def fleet_app(scope: Any, receive: Any, send: Any) -> None:
        if scope["server"][0] != "up":
            raise ConnectionError("no route to host")
        await app(scope, receive, send)

    async with ASGITransport(fleet_app) as http:
        await poll_once(router, lambda url: http.get(url, 5.0))
    up, gone = router.by_name["up"], router.by_name["gone"]
    assert (up.waiting_gauge, up.kv_usage_gauge) == (0.0, 0.0)
    assert gone.failures == 1 and gone.is_down(router.clock())
    up.waiting_gauge = 3.0  # another client's queue: the router sees it as full
    assert router.is_full(up)
