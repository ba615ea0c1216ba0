"""``libra bench engine``: the engine's own overhead, beside bare HTTP clients.

A zero-latency emulated server runs on a real port in its own process, so every
second measured is spent in HTTP and in the client. At each concurrency level the
engine runs trajectories of a small tool-using env (the emulator's ``agent`` script
decides turns and tool calls); then bare clients replay the engine's generation
requests, body for body, with as many in flight, to the same server: aiohttp, the
engine's own transport alone (``HttptoolsTransport``, no engine above it) and httpx.
The ratio of the engine's calls/s to bare aiohttp's is the engine's cost against the
common client; its ratio to the bare transport's is what the engine adds above the HTTP
it uses; bare httpx shows why the engine does not use httpx's own transport.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass
from typing import Any, Literal, Self
from urllib.parse import urlsplit

import aiohttp
import anyio
import httpx
import msgspec

from libra.emulation import EmulatorConfig, LatencyModel, running_emulator
from libra.engine import (
    Engine,
    EngineConfig,
    HttptoolsTransport,
    HTTPTransport,
    SamplingConfig,
    TransportError,
    http_transport,
    jobs_for,
    rollout,
)
from libra.envs import Env, tool
from libra.fleet import Endpoint
from libra.sched.policies import LeastLoadedScheduler

MAX_CONNECTIONS = 1024  # the same pool bound for the engine and the bare clients
HTTPX_BUDGET_S = 15.0
_HEADERS = {"content-type": "application/json"}


class Lookup(Env):
    """A cheap multi-turn env: the tool costs nothing, so only the engine is measured."""

    max_turns = 6

    def reset(self, seed: int) -> str:
        return f"Look up item {seed % 1000} and report its value."

    @tool
    async def lookup(self, item: int) -> str:
        """Look up an item's value."""
        return f"item {item} has value {item * 7 % 101}"

    def reward(self, answer: str) -> float:
        return float("value" in answer)


@dataclass
class EngineBenchResult:
    """One concurrency level: medians over ``pairs`` back-to-back runs of the engine and
    of bare aiohttp (the machine's other load drifts between runs: a pair shares it)."""

    concurrency: int
    trajectories: int
    calls: int
    pairs: int
    trajectories_s: float
    calls_s: float
    bare_aiohttp_calls_s: float
    bare_httptools_calls_s: float
    bare_httpx_calls_s: float
    bare_httpx_in_flight: int
    errors: int
    bare_errors: int
    # Client CPU per call: robust to other load on the machine, unlike calls/s.
    cpu_us_per_call: float
    bare_aiohttp_cpu_us_per_call: float
    bare_httptools_cpu_us_per_call: float
    # Engine over bare aiohttp within each pair: calls/s, and CPU per call.
    calls_ratio_per_pair: list[float]
    cpu_ratio_per_pair: list[float]
    # Engine over its own transport alone (bare httptools), within each pair.
    httptools_calls_ratio_per_pair: list[float]
    httptools_cpu_ratio_per_pair: list[float]


@dataclass(frozen=True)
class _Pair:
    trajectories_s: float
    calls_s: float
    cpu_s_per_call: float
    errors: int
    bare_calls_s: float
    bare_cpu_s_per_call: float
    bare_errors: int
    transport_calls_s: float
    transport_cpu_s_per_call: float


async def bench_engine(
    url: str,
    concurrency: int,
    trajectories: int,
    api: Literal["chat", "tokens"] = "chat",
    pairs: int = 3,
) -> EngineBenchResult:
    runs: list[_Pair] = []
    requests: list[tuple[str, bytes]] = []  # the last engine run's, for httpx
    for _ in range(pairs):
        pair, requests = await _pair(url, concurrency, trajectories, api)
        runs.append(pair)
    in_flight = min(concurrency, len(requests))
    # httpx's own transport is many times slower here: a time-boxed sample gives its rate,
    # with no more requests in flight than its pool has connections. (Measured here: with
    # 4,000 requests waiting on its pool, 10 s of calls had not ended after 300 s.)
    httpx_in_flight = min(in_flight, MAX_CONNECTIONS)
    httpx_rate, _, httpx_errors = await _bare(
        _bare_httpx, url, requests, httpx_in_flight, budget_s=HTTPX_BUDGET_S
    )
    return EngineBenchResult(
        concurrency=concurrency,
        trajectories=trajectories,
        calls=len(requests),
        pairs=pairs,
        trajectories_s=round(statistics.median(r.trajectories_s for r in runs), 1),
        calls_s=round(statistics.median(r.calls_s for r in runs), 1),
        bare_aiohttp_calls_s=round(statistics.median(r.bare_calls_s for r in runs), 1),
        bare_httptools_calls_s=round(statistics.median(r.transport_calls_s for r in runs), 1),
        bare_httpx_calls_s=round(httpx_rate, 1),
        bare_httpx_in_flight=httpx_in_flight,
        errors=sum(r.errors for r in runs),
        bare_errors=sum(r.bare_errors for r in runs) + httpx_errors,
        cpu_us_per_call=round(statistics.median(r.cpu_s_per_call for r in runs) * 1e6, 1),
        bare_aiohttp_cpu_us_per_call=round(
            statistics.median(r.bare_cpu_s_per_call for r in runs) * 1e6, 1
        ),
        bare_httptools_cpu_us_per_call=round(
            statistics.median(r.transport_cpu_s_per_call for r in runs) * 1e6, 1
        ),
        calls_ratio_per_pair=[round(r.calls_s / r.bare_calls_s, 3) for r in runs],
        cpu_ratio_per_pair=[round(r.cpu_s_per_call / r.bare_cpu_s_per_call, 3) for r in runs],
        httptools_calls_ratio_per_pair=[round(r.calls_s / r.transport_calls_s, 3) for r in runs],
        httptools_cpu_ratio_per_pair=[
            round(r.cpu_s_per_call / r.transport_cpu_s_per_call, 3) for r in runs
        ],
    )


async def _pair(
    url: str, concurrency: int, trajectories: int, api: Literal["chat", "tokens"]
) -> tuple[_Pair, list[tuple[str, bytes]]]:
    """The engine's run, then bare aiohttp and the bare transport replaying its
    generation requests; and those."""
    endpoint = Endpoint(url, model=EmulatorConfig().model_name, api=api)
    config = EngineConfig(
        concurrency=concurrency, sampling=SamplingConfig(max_tokens_per_turn=256, seed=0)
    )
    async with _Recording(http_transport(max_connections=MAX_CONNECTIONS)) as http:
        engine = Engine(http, LeastLoadedScheduler([endpoint]), config=config)
        jobs = jobs_for(Lookup, "lookup", trajectories, seed=concurrency)
        started, cpu_started = time.perf_counter(), time.process_time()
        stats = await rollout(jobs, engine)
        elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    calls = stats.turns
    # The bare client replays the engine's own generation requests, body for body.
    requests = [(path, body) for path, body in http.sent if path.startswith("/v1/")]
    in_flight = min(concurrency, calls)
    rate, bare_cpu, bare_errors = await _bare(_bare_aiohttp, url, requests, in_flight)
    transport_rate, transport_cpu, transport_errors = await _bare(
        _bare_httptools, url, requests, in_flight
    )
    pair = _Pair(
        trajectories_s=trajectories / elapsed,
        calls_s=calls / elapsed,
        cpu_s_per_call=cpu / calls,
        errors=stats.statuses["failed"],
        bare_calls_s=rate,
        bare_cpu_s_per_call=bare_cpu,
        bare_errors=bare_errors + transport_errors,
        transport_calls_s=transport_rate,
        transport_cpu_s_per_call=transport_cpu,
    )
    return pair, requests


class _Recording:
    """An HTTP transport that keeps every request it sends, for the bare clients to replay."""

    def __init__(self, inner: HTTPTransport) -> None:
        self.inner = inner
        self.sent: list[tuple[str, bytes]] = []

    async def post(
        self, url: str, body: bytes, headers: Mapping[str, str], timeout_s: float
    ) -> tuple[int, bytes]:
        self.sent.append((urlsplit(url).path, body))
        return await self.inner.post(url, body, headers, timeout_s)

    async def get(self, url: str, timeout_s: float) -> tuple[int, bytes]:
        return await self.inner.get(url, timeout_s)

    async def aclose(self) -> None:
        await self.inner.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


Post = Callable[[str, bytes], Awaitable[bool]]  # one request; True when it succeeded


async def _bare(
    open_client: Callable[[str], Any],
    url: str,
    requests: list[tuple[str, bytes]],
    in_flight: int,
    budget_s: float = math.inf,
) -> tuple[float, float, int]:
    """Calls per second of ``in_flight`` workers sending ``requests`` (stopping after
    ``budget_s``), client CPU seconds per call, and how many calls failed."""
    pending = iter(requests)
    done, errors = 0, 0
    async with open_client(url) as post:

        async def worker() -> None:
            nonlocal done, errors
            for path, body in pending:
                errors += not await post(path, body)
                done += 1

        started, cpu_started = time.perf_counter(), time.process_time()
        with anyio.move_on_after(budget_s):
            async with anyio.create_task_group() as group:
                for _ in range(in_flight):
                    group.start_soon(worker)
        elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu_started
        return done / elapsed, cpu / max(done, 1), errors


@asynccontextmanager
async def _bare_aiohttp(url: str) -> AsyncIterator[Post]:
    connector = aiohttp.TCPConnector(limit=MAX_CONNECTIONS)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def post(path: str, body: bytes) -> bool:
            try:
                async with session.post(url + path, data=body, headers=_HEADERS) as response:
                    msgspec.json.decode(await response.read())
                    return response.status == 200
            except aiohttp.ClientError:
                return False

        yield post


@asynccontextmanager
async def _bare_httptools(url: str) -> AsyncIterator[Post]:
    async with HttptoolsTransport(MAX_CONNECTIONS) as transport:

        async def post(path: str, body: bytes) -> bool:
            try:
                status, answer = await transport.post(url + path, body, _HEADERS, 120.0)
            except TransportError:
                return False
            msgspec.json.decode(answer)
            return status == 200

        yield post


@asynccontextmanager
async def _bare_httpx(url: str) -> AsyncIterator[Post]:
    limits = httpx.Limits(max_connections=MAX_CONNECTIONS)
    async with httpx.AsyncClient(limits=limits, timeout=120) as client:

        async def post(path: str, body: bytes) -> bool:
            try:
                response = await client.post(url + path, content=body, headers=_HEADERS)
                msgspec.json.decode(response.content)
                return response.status_code == 200
            except httpx.HTTPError:
                return False

        yield post


async def run_engine_bench(
    levels: Sequence[int] = (1000, 10000), min_trajectories: int = 4000, pairs: int = 3
) -> list[EngineBenchResult]:
    """One zero-latency server for all levels; each level runs at least ``min_trajectories``,
    ``pairs`` times."""
    results = []
    with running_emulator(EmulatorConfig(latency=LatencyModel.zero())) as url:
        for concurrency in levels:
            trajectories = max(concurrency, min_trajectories)
            results.append(await bench_engine(url, concurrency, trajectories, pairs=pairs))
    return results


def as_json(results: list[EngineBenchResult]) -> dict[str, object]:
    return {"results": [asdict(r) for r in results]}
