"""How fast a sandbox provider serves tool calls.

:func:`bench_sandbox` measures, for ``python3 -c 'print(1)'``:

- cold latency: a fresh sandbox (for Docker, a new container) plus its first call;
- warm latency: calls into a ready sandbox, one after another (p50 / p95);
- throughput: calls per second with N concurrent callers, each a trajectory with a sandbox of
  its own that makes its calls one after another (as tool calls in a trajectory do).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any, Literal

import anyio

from libra.envs import SandboxSpec
from libra.sandbox import BwrapSandboxProvider, DockerSandboxProvider

__all__ = ["bench_sandbox"]

ProviderKind = Literal["docker", "bwrap"]
Provider = DockerSandboxProvider | BwrapSandboxProvider
_CALL = ("python3", "-c", "print(1)")
_CALL_TIMEOUT_S = 60.0


def _percentiles(samples: Sequence[float]) -> dict[str, float]:
    """p50 / p95 (nearest rank), mean and count of latencies in seconds."""
    ordered = sorted(samples)

    def rank(q: float) -> float:
        return ordered[max(math.ceil(q * len(ordered)) - 1, 0)]

    return {
        "p50_s": round(rank(0.50), 4),
        "p95_s": round(rank(0.95), 4),
        "mean_s": round(sum(ordered) / len(ordered), 4),
        "n": len(ordered),
    }


@contextlib.asynccontextmanager
async def _provider(kind: ProviderKind, pool_size: int) -> AsyncIterator[Provider]:
    provider: Provider
    if kind == "docker":
        provider = DockerSandboxProvider(pool_size=pool_size)
    elif kind == "bwrap":
        provider = BwrapSandboxProvider()
    else:
        raise ValueError(f"unknown provider kind {kind!r}")
    async with provider:
        yield provider


async def _timed_call(provider: Provider, spec: SandboxSpec, *, fresh: bool) -> float:
    """Seconds for one call; with ``fresh`` the sandbox is made (and closed) around it."""
    started = time.monotonic()
    async with provider.sandbox(spec) as box:
        result = await box.exec(_CALL, timeout_s=_CALL_TIMEOUT_S)
        elapsed = time.monotonic() - started
    if not result.ok:
        raise RuntimeError(f"benchmark call failed: {result}")
    return elapsed if fresh else result.duration_s


async def _cold(kind: ProviderKind, spec: SandboxSpec, samples: int) -> dict[str, float]:
    # pool_size 0: every sandbox is a new container, as on a cold start.
    async with _provider(kind, pool_size=0) as provider:
        return _percentiles([await _timed_call(provider, spec, fresh=True) for _ in range(samples)])


async def _warm(provider: Provider, spec: SandboxSpec, samples: int) -> dict[str, float]:
    latencies: list[float] = []
    async with provider.sandbox(spec) as box:
        await box.exec(_CALL, timeout_s=_CALL_TIMEOUT_S)  # the first call may warm caches
        for _ in range(samples):
            result = await box.exec(_CALL, timeout_s=_CALL_TIMEOUT_S)
            latencies.append(result.duration_s)
    return _percentiles(latencies)


async def _throughput(
    provider: Provider, spec: SandboxSpec, callers: int, calls: int
) -> dict[str, float]:
    """``calls`` calls spread over ``callers`` concurrent trajectories."""
    if isinstance(provider, DockerSandboxProvider):
        await provider.prewarm(spec, callers)
    per_caller = [calls // callers + (1 if i < calls % callers else 0) for i in range(callers)]
    latencies: list[float] = []

    async def trajectory(count: int) -> None:
        async with provider.sandbox(spec) as box:
            for _ in range(count):
                result = await box.exec(_CALL, timeout_s=_CALL_TIMEOUT_S)
                if not result.ok:
                    raise RuntimeError(f"benchmark call failed: {result}")
                latencies.append(result.duration_s)

    started = time.monotonic()
    async with anyio.create_task_group() as group:
        for count in per_caller:
            group.start_soon(trajectory, count)
    seconds = time.monotonic() - started
    return {
        "calls": calls,
        "seconds": round(seconds, 3),
        "calls_per_s": round(calls / seconds, 1),
        **_percentiles(latencies),
    }


async def bench_sandbox(
    provider_kind: ProviderKind = "docker",
    concurrency: Sequence[int] = (8, 32),
    calls: int = 256,
    *,
    cold_samples: int = 3,
    warm_samples: int = 30,
    spec: SandboxSpec | None = None,
) -> dict[str, Any]:
    """Latency and throughput of ``python3 -c 'print(1)'`` tool calls (see the module doc).

    Needs the sandbox image (``libra/python``) built; see :func:`libra.sandbox.build_image`.
    Throughput sandboxes are started before the clock starts (a warm pool).
    """
    spec = spec or SandboxSpec()
    report: dict[str, Any] = {"provider": provider_kind, "call": " ".join(_CALL)}
    report["cold_s"] = await _cold(provider_kind, spec, cold_samples)
    async with _provider(provider_kind, pool_size=max(concurrency, default=1)) as provider:
        report["warm_exec_s"] = await _warm(provider, spec, warm_samples)
        report["throughput"] = {
            str(callers): await _throughput(provider, spec, callers, max(calls, callers))
            for callers in concurrency
        }
    return report
