"""The gateway's Prometheus metrics: counted per route and bucket, read from the router
and the policy's decisions when scraped."""

from __future__ import annotations

from libra.fleet import Endpoint
from libra.gateway._metrics import GatewayMetrics
from libra.sched import Router
from libra.sched.policies import CMLFQ


def samples(metrics: GatewayMetrics) -> dict[str, float]:
    lines = metrics.exposition().decode().splitlines()
    pairs = [line.rsplit(" ", 1) for line in lines if not line.startswith("#")]
    return {name: float(value) for name, value in pairs}


def test_promotions_and_demotions_come_from_the_policys_decisions() -> None:
    router = Router.over([Endpoint("http://a", model="m"), Endpoint("http://b", model="m")])
    policy = CMLFQ(router)
    metrics = GatewayMetrics(router, lambda: policy.reasons)
    policy.reasons.update({"to_shorter": 2, "to_shorter+all_full": 1, "to_longer": 4, "stay": 9})
    values = samples(metrics)
    assert values["libra_gateway_promotions_total"] == 3
    assert values["libra_gateway_demotions_total"] == 4
    names = [i.name for i in router.instances]
    for name in names:
        key = f'libra_gateway_upstream_in_flight{{bucket="all",endpoint="{name}"}}'
        assert values[key] == 0


def test_requests_tokens_and_latency_are_counted_per_route_and_bucket() -> None:
    metrics = GatewayMetrics()
    chat = metrics.route("chat")
    metrics.answered(chat, 200, 0.002)
    metrics.answered(chat, 200, 0.004)
    metrics.answered(metrics.route("chat"), 400, 0.001)
    metrics.generated("short", "a", prompt=100, completion=20)
    values = samples(metrics)
    assert values['libra_gateway_requests_total{route="chat",status="200"}'] == 2
    assert values['libra_gateway_requests_total{route="chat",status="400"}'] == 1
    assert values['libra_gateway_request_seconds_count{route="chat"}'] == 3
    assert values['libra_gateway_tokens_total{bucket="short",kind="prompt"}'] == 100
    assert values['libra_gateway_bucket_requests_total{bucket="short",endpoint="a"}'] == 1
    assert (metrics.totals.requests, metrics.totals.errors) == (3, 1)
    assert metrics.totals.completion_tokens == 20
