"""The emulated server's vLLM endpoints beyond OpenAI's: ``/health``, ``/metrics`` and the
dev-mode RL routes (``/pause``, ``/resume``, ``/is_paused``, ``/collective_rpc``,
``/reset_prefix_cache``). Each handler takes the app whose state it reads."""

from __future__ import annotations

import json
import urllib.parse
from typing import TYPE_CHECKING, Any

import anyio

from libra._asgi import Receive
from libra.emulation._batching import PauseMode
from libra.emulation._http import JSON, HTTPError, Response, encode

if TYPE_CHECKING:
    from libra.emulation._app import EmulatorApp

_PAUSE_MODES: tuple[PauseMode, ...] = ("abort", "wait", "keep")
_PROMETHEUS = b"text/plain; version=0.0.4; charset=utf-8"


async def health(app: EmulatorApp, body: bytes, receive: Receive, query: bytes) -> Response:
    return 200, b"", JSON


async def metrics(app: EmulatorApp, body: bytes, receive: Receive, query: bytes) -> Response:
    engine, cache = app.engine, app.prefix_cache
    gauges = {
        "vllm:num_requests_running": engine.num_running if engine else 0,
        "vllm:num_requests_waiting": engine.num_waiting if engine else 0,
        "vllm:kv_cache_usage_perc": engine.kv_usage if engine else 0.0,
    }
    counters = {
        "vllm:prompt_tokens_total": app.prompt_tokens_total,
        "vllm:generation_tokens_total": app.generation_tokens_total,
        "vllm:prefix_cache_queries_total": cache.queries if cache else 0,
        "vllm:prefix_cache_hits_total": cache.hits if cache else 0,
        "vllm:num_preemptions_total": engine.num_preemptions if engine else 0,
    }
    name = app.config.model_name.replace("\\", "\\\\").replace('"', '\\"')
    label = f'{{model_name="{name}"}}'
    lines: list[str] = []
    for kind, values in (("gauge", gauges), ("counter", counters)):
        for metric, value in values.items():
            lines.append(f"# TYPE {metric} {kind}")
            lines.append(f"{metric}{label} {float(value)}")
    return 200, ("\n".join(lines) + "\n").encode(), _PROMETHEUS


async def pause(app: EmulatorApp, body: bytes, receive: Receive, query: bytes) -> Response:
    """vLLM's ``POST /pause?mode=abort|wait|keep`` (its dev-mode RL route): new
    requests queue until ``/resume``; ``abort`` ends those in flight now with the
    tokens produced so far (``finish_reason: "abort"``), ``wait`` answers once the
    running ones have finished, ``keep`` freezes them. (vLLM's deprecated
    ``clear_cache`` is accepted and ignored.)"""
    mode = urllib.parse.parse_qs(query.decode()).get("mode", ["abort"])[-1]
    if mode not in _PAUSE_MODES:
        return 422, encode(_invalid_mode(mode)), JSON
    if app.engine is None:
        app.resumed = app.resumed or anyio.Event()
    else:
        app.engine.pause(mode)
        if mode == "wait":
            await app.engine.wait_until_idle()
    return 200, b'{"status":"paused"}', JSON


async def resume(app: EmulatorApp, body: bytes, receive: Receive, query: bytes) -> Response:
    if app.engine is not None:
        app.engine.resume()
    elif app.resumed is not None:
        app.resumed.set()
        app.resumed = None
    return 200, b'{"status":"resumed"}', JSON


async def is_paused(app: EmulatorApp, body: bytes, receive: Receive, query: bytes) -> Response:
    engine = app.engine
    paused = app.resumed is not None if engine is None else engine.paused is not None
    return 200, encode({"is_paused": paused}), JSON


async def collective_rpc(app: EmulatorApp, body: bytes, receive: Receive, query: bytes) -> Response:
    """vLLM's dev-mode ``POST /collective_rpc``: ``reload_weights`` (what a weight
    sync calls) succeeds at once, as replies do not depend on weights here."""
    method = json.loads(body or b"{}").get("method")
    if method != "reload_weights":
        raise HTTPError(400, f"the emulator runs no {method!r} RPC")
    app.weight_reloads += 1
    return 200, b'{"results":[null]}', JSON


async def reset_prefix_cache(
    app: EmulatorApp, body: bytes, receive: Receive, query: bytes
) -> Response:
    """vLLM's dev-mode ``POST /reset_prefix_cache``: cached KV is forgotten."""
    if app.prefix_cache is not None:
        app.prefix_cache.clear()
    return 200, b'{"success":true}', JSON


def _invalid_mode(mode: str) -> dict[str, Any]:
    """FastAPI's validation error, as vLLM answers a ``/pause`` mode it does not know."""
    message = "Input should be 'wait', 'abort' or 'keep'"
    detail = {"type": "literal_error", "loc": ["query", "mode"], "msg": message, "input": mode}
    return {"detail": [detail]}
