"""Optional live gauges from vLLM's ``/metrics``, and a health check for free.

The router's own counts (calls in flight, their prompt tokens) are exact when it is the
servers' only client. When other clients share the servers, poll their Prometheus
``/metrics``: ``vllm:num_requests_waiting`` feeds the router's notion of a full queue and
``vllm:kv_cache_usage_perc`` its view of memory; a server that does not answer is
marked failed (avoided for a cooldown that doubles while it keeps failing).
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable

import anyio

from libra.sched._buckets import Router

Get = Callable[[str], Awaitable[tuple[int, bytes]]]
"""GET a URL; the status and body (e.g. ``lambda url: transport.get(url, 5.0)``)."""

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{[^}]*\})?\s+(\S+)", re.MULTILINE)
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"


def parse_metrics(text: str) -> dict[str, float]:
    """Sample values of a Prometheus text exposition, summed over label sets."""
    values: dict[str, float] = {}
    for name, value in _SAMPLE.findall(text):
        try:
            values[name] = values.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return values


async def poll_once(router: Router, get: Get) -> None:
    """Read every instance's gauges once; mark the ones that fail to answer."""
    for instance in list(router.instances):  # membership may change while we await
        try:
            status, body = await get(instance.endpoint.url + "/metrics")
        except Exception:  # unreachable or broken: the router avoids it for a while
            if instance.state == "active":
                router.mark_failed(instance)
            continue
        if status != 200:
            if instance.state == "active":
                router.mark_failed(instance)
            continue
        values = parse_metrics(body.decode(errors="replace"))
        instance.waiting_gauge = values.get(WAITING)
        instance.kv_usage_gauge = values.get(KV_USAGE)


async def poll_metrics(router: Router, get: Get, interval_s: float = 2.0) -> None:
    """Poll forever (run it in a task group beside the rollout; cancel to stop)."""
    while True:
        await poll_once(router, get)
        await anyio.sleep(interval_s)
