"""The gateway's Prometheus metrics: counted per route as requests go by, folded from
the engine's events as they are published, read from the router when scraped."""

from __future__ import annotations

from libra.events import BucketMoved, CallEnded, EventBus
from libra.gateway._metrics import GatewayMetrics
from libra.sched import Router
from tests._helpers import fleet


def samples(metrics: GatewayMetrics) -> dict[str, float]:
    lines = metrics.exposition().decode().splitlines()
    pairs = [line.rsplit(" ", 1) for line in lines if not line.startswith("#")]
    return {name: float(value) for name, value in pairs}


def call(bucket: str, instance: str, outcome: str = "ok") -> CallEnded:
    return CallEnded(
        t=0.0,
        id="t1",
        turn=0,
        instance=instance,
        bucket=bucket,
        seconds=0.5,
        new_tokens=20,
        outcome=outcome,
        weight_version=0,
        prompt_tokens=100,
    )


def test_calls_tokens_and_moves_are_folded_from_the_published_events() -> None:
    router, bus = Router(fleet()), EventBus()
    metrics = GatewayMetrics(router, bus)
    bus.publish(call("short", "a1"))
    bus.publish(call("short", "a1", outcome="migrated"))
    bus.publish(BucketMoved(t=1.0, id="t1", source="short", target="long", tool="run_tests"))
    bus.publish(call("long", "c"))
    bus.publish(BucketMoved(t=2.0, id="t1", source="long", target="medium"))
    bus.publish(BucketMoved(t=3.0, id="t2", source="medium", target="short"))
    bus.publish(BucketMoved(t=4.0, id="t3", source="gone", target="short"))  # not in the fleet
    values = samples(metrics)
    requests = "libra_gateway_bucket_requests_total"
    assert values[f'{requests}{{bucket="short",endpoint="a1",outcome="ok"}}'] == 1
    assert values[f'{requests}{{bucket="short",endpoint="a1",outcome="migrated"}}'] == 1
    assert values[f'{requests}{{bucket="long",endpoint="c",outcome="ok"}}'] == 1
    assert values['libra_gateway_tokens_total{bucket="short",kind="prompt"}'] == 200
    assert values['libra_gateway_tokens_total{bucket="long",kind="completion"}'] == 20
    assert values["libra_gateway_promotions_total"] == 2
    assert values["libra_gateway_demotions_total"] == 1
    assert (metrics.totals.prompt_tokens, metrics.totals.completion_tokens) == (300, 60)
    for name in ("a1", "a2", "b", "c"):
        bucket = router.by_name[name].bucket
        key = f'libra_gateway_upstream_in_flight{{bucket="{bucket}",endpoint="{name}"}}'
        assert values[key] == 0


def test_requests_and_latency_are_counted_per_route() -> None:
    metrics = GatewayMetrics()
    chat = metrics.route("chat")
    metrics.answered(chat, 200, 0.002)
    metrics.answered(chat, 200, 0.004)
    metrics.answered(metrics.route("chat"), 400, 0.001)
    values = samples(metrics)
    assert values['libra_gateway_requests_total{route="chat",status="200"}'] == 2
    assert values['libra_gateway_requests_total{route="chat",status="400"}'] == 1
    assert values['libra_gateway_request_seconds_count{route="chat"}'] == 3
    assert values["libra_gateway_promotions_total"] == 0
    assert (metrics.totals.requests, metrics.totals.errors) == (3, 1)
