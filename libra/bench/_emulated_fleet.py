"""The in-process emulated fleet that the scheduling, allocation and soak benchmarks run
their steps against, in trio's virtual time: emulated servers playing a workload's scripts,
the engine's settings for a benchmark step, and trio's tie-breaks seeded so a run repeats."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio
from trio.testing import MockClock

from libra.bench._sched_fleet import FleetFile
from libra.emulation import EmulatorApp, EmulatorConfig, create_app
from libra.emulation.workloads import Book, Mix, Workload, WorkloadScript
from libra.engine import EngineConfig, SamplingConfig

MODEL = "libra-emulated"
T = TypeVar("T")
CONTEXT_MARGIN = 4096  # template tokens beyond the workload's own context limit
_FOREVER_S = 1e7  # request, call and trajectory limits: a benchmark step never hits them


def server_config(
    workload: Workload | Mix, fleet: FleetFile, seed: int, context_margin: int
) -> EmulatorConfig:
    """The settings of one emulated server of a benchmark step (its latency is the
    caller's to set)."""
    return EmulatorConfig(
        model_name=MODEL,
        prefix_caching=fleet.serving.prefix_caching,
        max_model_len=workload.limits.max_context_tokens + 2 * context_margin,
        seed=seed,
    )


def emulated_servers(configs: dict[str, EmulatorConfig], book: Book) -> dict[str, EmulatorApp]:
    """One emulated server per instance (by name), all playing ``book``'s scripts, each
    with a batching engine for its caller to observe."""
    script = WorkloadScript(book)
    apps: dict[str, EmulatorApp] = {}
    for name, config in configs.items():
        app = apps[name] = create_app(config, script)
        assert app.engine is not None  # a benchmark's latency model is never zero
    return apps


def engine_config(workload: Workload | Mix, concurrency: int, seed: int) -> EngineConfig:
    """The engine's settings for a benchmark step: the workload's limits, no timeouts."""
    limits = workload.limits
    return EngineConfig(
        concurrency=concurrency,
        max_turns=limits.max_turns,
        max_context_tokens=limits.max_context_tokens + CONTEXT_MARGIN,
        max_wall_s=_FOREVER_S,
        tool_timeout_s=limits.tool_timeout_s,
        request_timeout_s=_FOREVER_S,
        call_timeout_s=_FOREVER_S,  # a call queued behind a long batch is not a hang here
        stall_warning_s=_FOREVER_S,
        sampling=SamplingConfig(max_tokens_per_turn=limits.max_context_tokens, seed=seed),
    )


def seed_trio_scheduler(seed: int) -> None:
    """Trio breaks ties between tasks ready at the same instant with an unseeded RNG
    (to shake out order dependencies); seed it so that a run repeats exactly."""
    from trio._core import _run  # trio offers no public switch for this

    _run._r.seed(seed)


def in_virtual_time(func: Callable[..., Awaitable[T]], *args: Any, seed: int) -> T:
    """``func(*args)`` on trio's virtual clock (it jumps to the next deadline whenever
    every task waits): hours of emulated serving in seconds, and a run that repeats for
    ``seed``."""
    seed_trio_scheduler(seed)
    clock = MockClock(autojump_threshold=0)
    return anyio.run(func, *args, backend="trio", backend_options={"clock": clock})
