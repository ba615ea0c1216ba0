"""``libra bench engine --view``: what the live view costs the engine.

At each concurrency level the engine runs the same trajectories as ``libra bench
engine`` (the ``Lookup`` env against a zero-latency emulated server on a real port)
twice in a pair, without the view and with it, in alternating order: with it, the
engine publishes every event to a bus, the view's history encodes them in batches, the
view is served, and a reader in another process (curl, as a browser would be) streams
``/events`` for the whole run. The ratio is the calls/s with the view over without it,
per pair; the median of the pairs is the figure.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import time
from contextlib import AsyncExitStack
from dataclasses import asdict, dataclass

import anyio

from libra.bench._engine import MAX_CONNECTIONS, Lookup
from libra.emulation import EmulatorConfig, LatencyModel, running_emulator
from libra.engine import Engine, EngineConfig, SamplingConfig, http_transport, jobs_for, rollout
from libra.events import EventBus
from libra.fleet import Endpoint
from libra.sched.policies import LeastLoadedScheduler
from libra.view import History, serve_view

__all__ = ["ViewBenchResult", "as_json", "run_view_bench"]


@dataclass(frozen=True)
class ViewBenchResult:
    concurrency: int
    trajectories: int
    pairs: int
    calls_s: float  # without the view: the median of the pairs
    view_calls_s: float  # with it
    events: int  # published in the last run with the view
    ratio_per_pair: list[float]

    @property
    def ratio(self) -> float:
        return statistics.median(self.ratio_per_pair)


async def _run(url: str, concurrency: int, trajectories: int, view: bool) -> tuple[float, int]:
    """One engine run; its calls/s and the events it published."""
    endpoint = Endpoint(url, model=EmulatorConfig().model_name, api="chat")
    config = EngineConfig(
        concurrency=concurrency, sampling=SamplingConfig(max_tokens_per_turn=256, seed=0)
    )
    bus = EventBus() if view else None
    history = History(live=True)
    async with AsyncExitStack() as stack:
        group = await stack.enter_async_context(anyio.create_task_group())
        if bus is not None:
            subscription = bus.subscribe()
            group.start_soon(history.follow, subscription)
            page = await stack.enter_async_context(serve_view(history))
            reader = _reader(page + "events")
            if reader is not None:
                stack.callback(_stop, reader)
        http = await stack.enter_async_context(http_transport(max_connections=MAX_CONNECTIONS))
        engine = Engine(http, LeastLoadedScheduler([endpoint]), config=config, events=bus)
        jobs = jobs_for(Lookup, "lookup", trajectories, seed=concurrency)
        started = time.perf_counter()
        stats = await rollout(jobs, engine)
        elapsed = time.perf_counter() - started
        if bus is not None:
            subscription.close()
    events = sum(batch.count(b'"kind"') for batch in history.batches)
    return stats.turns / elapsed, events


def _reader(url: str) -> subprocess.Popen[bytes] | None:
    """A page's stream, read in another process (as a browser would); None without curl."""
    curl = shutil.which("curl")
    if curl is None:
        return None
    return subprocess.Popen([curl, "-sN", url], stdout=subprocess.DEVNULL)


def _stop(process: subprocess.Popen[bytes]) -> None:
    process.kill()
    process.wait()


async def run_view_bench(
    levels: tuple[int, ...] = (1000, 10000), min_trajectories: int = 4000, pairs: int = 3
) -> list[ViewBenchResult]:
    results = []
    with running_emulator(EmulatorConfig(latency=LatencyModel.zero())) as url:
        for concurrency in levels:
            trajectories = max(concurrency, min_trajectories)
            without, with_view, ratios, events = [], [], [], 0
            for index in range(pairs):
                order = (False, True) if index % 2 == 0 else (True, False)
                rates = {}
                for view in order:
                    rates[view], published = await _run(url, concurrency, trajectories, view)
                    events = published or events
                without.append(rates[False])
                with_view.append(rates[True])
                ratios.append(round(rates[True] / rates[False], 3))
            results.append(
                ViewBenchResult(
                    concurrency,
                    trajectories,
                    pairs,
                    round(statistics.median(without), 1),
                    round(statistics.median(with_view), 1),
                    events,
                    ratios,
                )
            )
    return results


def as_json(results: list[ViewBenchResult]) -> dict[str, object]:
    return {"results": [asdict(r) | {"ratio": round(r.ratio, 3)} for r in results]}
