"""``libra bench engine``: the engine's own overhead, beside bare HTTP clients.

A zero-latency emulated server runs on a real port in its own process, so every
second measured is spent in HTTP and in the client. At each concurrency level the
engine runs trajectories of a small tool-using env (the emulator's ``agent`` script
decides turns and tool calls); then a bare aiohttp client and a bare httpx client make
the same number of chat-completion calls, with the same body and the same number in
flight, to the same server. The ratio of the engine's calls/s to bare aiohttp's is the
engine's overhead; bare httpx shows why the engine does not use httpx's own transport.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass

import aiohttp
import anyio
import httpx
import msgspec

from libra import openai
from libra.emulation import EmulatorConfig, LatencyModel, running_emulator
from libra.engine import (
    Engine,
    EngineConfig,
    OpenAIClient,
    SamplingConfig,
    http_transport,
    jobs_for,
    rollout,
)
from libra.envs import Env, tool
from libra.sched import Endpoint, LeastLoadedScheduler

MAX_CONNECTIONS = 1024  # the same pool bound for the engine and both bare clients


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
    concurrency: int
    trajectories: int
    calls: int
    trajectories_s: float
    calls_s: float
    bare_aiohttp_calls_s: float
    bare_httpx_calls_s: float
    errors: int
    bare_errors: int


async def bench_engine(
    url: str, concurrency: int, trajectories: int, api: str = "chat"
) -> EngineBenchResult:
    endpoint = Endpoint(url, model=EmulatorConfig().model_name, api=api)  # type: ignore[arg-type]
    config = EngineConfig(
        concurrency=concurrency, sampling=SamplingConfig(max_tokens_per_turn=256, seed=0)
    )
    async with http_transport("aiohttp", max_connections=MAX_CONNECTIONS) as http:
        engine = Engine(OpenAIClient(http), LeastLoadedScheduler([endpoint]), config=config)
        jobs = jobs_for(Lookup, "lookup", trajectories, seed=concurrency)
        started = time.perf_counter()
        stats = await rollout(jobs, engine)
        elapsed = time.perf_counter() - started
    calls = stats.turns
    body = _first_turn_body(endpoint.model)
    in_flight = min(concurrency, calls)
    aiohttp_s, aiohttp_errors = await _bare(_aiohttp_caller, url, body, calls, in_flight)
    httpx_s, httpx_errors = await _bare(_httpx_caller, url, body, calls, in_flight)
    return EngineBenchResult(
        concurrency=concurrency,
        trajectories=trajectories,
        calls=calls,
        trajectories_s=round(trajectories / elapsed, 1),
        calls_s=round(calls / elapsed, 1),
        bare_aiohttp_calls_s=round(calls / aiohttp_s, 1),
        bare_httpx_calls_s=round(calls / httpx_s, 1),
        errors=stats.statuses["failed"],
        bare_errors=aiohttp_errors + httpx_errors,
    )


def _first_turn_body(model: str) -> bytes:
    request = openai.ChatCompletionRequest(
        model=model,
        messages=[openai.Message(role="user", content=Lookup().reset(1))],
        tools=Lookup.tool_schemas(),
        max_tokens=256,
        logprobs=True,
        return_token_ids=True,
        seed=0,
    )
    return msgspec.json.encode(request)


Caller = Callable[[str, bytes], Awaitable[Callable[[], Awaitable[bool]]]]


async def _bare(
    make_caller: Callable[[str, bytes, Callable[[], None]], Awaitable[None]],
    url: str,
    body: bytes,
    calls: int,
    in_flight: int,
) -> tuple[float, int]:
    """Seconds for ``calls`` requests with ``in_flight`` workers, and the failures."""
    remaining = [calls]
    errors = [0]

    def take() -> bool:
        if remaining[0] == 0:
            return False
        remaining[0] -= 1
        return True

    started = time.perf_counter()
    await make_caller(url, body, lambda: errors.__setitem__(0, errors[0] + 1), in_flight, take)  # type: ignore[call-arg]
    return time.perf_counter() - started, errors[0]


async def _aiohttp_caller(
    url: str, body: bytes, error: Callable[[], None], in_flight: int, take: Callable[[], bool]
) -> None:  # type: ignore[no-untyped-def]
    connector = aiohttp.TCPConnector(limit=MAX_CONNECTIONS)
    headers = {"content-type": "application/json"}
    async with aiohttp.ClientSession(connector=connector) as session:

        async def worker() -> None:
            while take():
                try:
                    async with session.post(
                        url + "/v1/chat/completions", data=body, headers=headers
                    ) as response:
                        payload = await response.read()
                        if response.status != 200:
                            error()
                        msgspec.json.decode(payload)
                except aiohttp.ClientError:
                    error()

        async with anyio.create_task_group() as group:
            for _ in range(in_flight):
                group.start_soon(worker)


async def _httpx_caller(
    url: str, body: bytes, error: Callable[[], None], in_flight: int, take: Callable[[], bool]
) -> None:  # type: ignore[no-untyped-def]
    limits = httpx.Limits(
        max_connections=MAX_CONNECTIONS, max_keepalive_connections=MAX_CONNECTIONS
    )
    headers = {"content-type": "application/json"}
    async with httpx.AsyncClient(limits=limits, timeout=120) as client:

        async def worker() -> None:
            while take():
                try:
                    response = await client.post(
                        url + "/v1/chat/completions", content=body, headers=headers
                    )
                    if response.status_code != 200:
                        error()
                    msgspec.json.decode(response.content)
                except httpx.HTTPError:
                    error()

        async with anyio.create_task_group() as group:
            for _ in range(in_flight):
                group.start_soon(worker)


async def run_engine_bench(levels: tuple[int, ...] = (1000, 10000)) -> list[EngineBenchResult]:
    results = []
    with running_emulator(EmulatorConfig(latency=LatencyModel.zero())) as url:
        for concurrency in levels:
            results.append(await bench_engine(url, concurrency, max(concurrency, 4000)))
    return results


def as_json(results: list[EngineBenchResult]) -> dict[str, object]:
    return {"results": [asdict(r) for r in results]}
