"""``libra bench serve``: what ``libra serve`` adds, beside calling the servers directly.

A zero-latency emulated server runs on a real port in its own process, and ``libra
serve`` in another, in front of it (``--server URL``, no auth, on loopback). At each
concurrency level, as many client sessions as the level each send one chat request at a
time for a fixed time: first straight to the emulated server, then through the gateway
(the same bodies); the pair runs three times, and each path's medians are reported
(other load on the machine drifts between runs: a pair shares it). Every second
measured is HTTP, the gateway and the clients, so the differences of the latency
percentiles are what the gateway adds, and the gateway's
requests/s is its maximum rate on this machine (with the client and the server
sharing its cores). The clients are the engine's own HTTP client
(``HttptoolsTransport``), the lightest measured here, so that they take as little of
the cores from the servers as they can.

Each gateway request starts a new session (a one-turn conversation, as a stateless
client's would be); sessions end after a short idle TTL so memory stays flat.
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import anyio

from libra.emulation import EmulatorConfig, LatencyModel, emulator_process
from libra.engine import HttptoolsTransport, TransportError

_HEADERS = {"content-type": "application/json"}
_MODEL = "libra-emulated"
_TIMEOUT_S = 60.0


@dataclass
class Latencies:
    requests: int
    errors: int
    requests_s: float
    p50_ms: float
    p99_ms: float
    # CPU of the process that answered (the emulated server; the gateway), per request:
    # robust to other load on the machine, unlike requests/s and latencies.
    server_cpu_us: float = float("nan")


@dataclass
class ServeBenchResult:
    """One level: each path's medians over ``pairs`` back-to-back runs (direct, then
    through the gateway: the machine's other load drifts between runs, a pair shares it)."""

    concurrency: int
    direct: Latencies
    gateway: Latencies
    pairs: int = 1
    added_p50_ms_per_pair: list[float] = field(default_factory=list)

    @property
    def added_p50_ms(self) -> float:
        return self.gateway.p50_ms - self.direct.p50_ms

    @property
    def added_p99_ms(self) -> float:
        return self.gateway.p99_ms - self.direct.p99_ms


def as_json(results: Sequence[ServeBenchResult]) -> dict[str, Any]:
    levels = [
        {**asdict(r), "added_p50_ms": r.added_p50_ms, "added_p99_ms": r.added_p99_ms}
        for r in results
    ]
    best = max((r.gateway.requests_s for r in results), default=0.0)
    return {"levels": levels, "gateway_max_requests_s": best}


@dataclass(frozen=True)
class _Server:
    url: str
    pid: int


def bench_serve(
    concurrency: Sequence[int], seconds: float, pairs: int = 3
) -> list[ServeBenchResult]:
    config = EmulatorConfig(latency=LatencyModel.zero(), script="echo")
    with emulator_process(config) as emulator, _gateway(emulator.url) as gateway:
        upstream = _Server(emulator.url, emulator.process.pid)
        return anyio.run(
            _measure_levels, upstream, gateway, tuple(concurrency), seconds, pairs,
            backend_options={"use_uvloop": True},
        )  # fmt: skip


async def _measure_levels(
    upstream: _Server, gateway: _Server, levels: tuple[int, ...], seconds: float, pairs: int
) -> list[ServeBenchResult]:
    results = []
    async with HttptoolsTransport(max_connections=max(levels, default=1)) as http:
        await _load(http, gateway, 8, 0.5)  # warm both up: connections, caches
        await _load(http, upstream, 8, 0.5)
        for level in levels:
            direct, through = [], []
            for _ in range(pairs):
                direct.append(await _load(http, upstream, level, seconds))
                through.append(await _load(http, gateway, level, seconds))
            added = [g.p50_ms - d.p50_ms for d, g in zip(direct, through, strict=True)]
            results.append(
                ServeBenchResult(level, _medians(direct), _medians(through), pairs, added)
            )
    return results


def _medians(runs: list[Latencies]) -> Latencies:
    """Runs of one path: their requests and errors summed, each rate and time's median."""
    median = statistics.median
    return Latencies(
        requests=sum(r.requests for r in runs),
        errors=sum(r.errors for r in runs),
        requests_s=median(r.requests_s for r in runs),
        p50_ms=median(r.p50_ms for r in runs),
        p99_ms=median(r.p99_ms for r in runs),
        server_cpu_us=median(r.server_cpu_us for r in runs),
    )


def _cpu_s(pid: int) -> float:
    """CPU seconds (user and system) process ``pid`` has used; nan off Linux."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _load(
    http: HttptoolsTransport, server: _Server, sessions: int, seconds: float
) -> Latencies:
    """``sessions`` clients, each one request at a time, for ``seconds``."""
    url = f"{server.url}/v1/chat/completions"
    latencies: list[float] = []
    errors = 0
    deadline = time.perf_counter() + seconds

    async def client(number: int) -> None:
        nonlocal errors
        request = 0
        while time.perf_counter() < deadline:
            request += 1
            body = _body(number, request)
            started = time.perf_counter()
            try:
                status, _ = await http.post(url, body, _HEADERS, _TIMEOUT_S)
            except TransportError:
                status = 0
            errors += status != 200
            latencies.append(time.perf_counter() - started)

    started, cpu = time.perf_counter(), _cpu_s(server.pid)
    async with anyio.create_task_group() as group:
        for number in range(sessions):
            group.start_soon(client, number)
    elapsed = time.perf_counter() - started
    summary = _summary(latencies, errors, elapsed)
    if latencies:
        summary.server_cpu_us = (_cpu_s(server.pid) - cpu) / len(latencies) * 1e6
    return summary


def _body(client: int, request: int) -> bytes:
    text = f"Client {client} asks question {request}: what is {client} plus {request}?"
    messages = f'[{{"role": "user", "content": "{text}"}}]'
    return f'{{"model": "{_MODEL}", "messages": {messages}, "max_tokens": 16}}'.encode()


def _summary(latencies: list[float], errors: int, elapsed: float) -> Latencies:
    if len(latencies) < 2:
        return Latencies(len(latencies), errors, 0.0, float("nan"), float("nan"))
    cuts = statistics.quantiles(latencies, n=100)
    return Latencies(
        requests=len(latencies),
        errors=errors,
        requests_s=len(latencies) / elapsed,
        p50_ms=statistics.median(latencies) * 1000,
        p99_ms=cuts[98] * 1000,
    )


@contextmanager
def _gateway(upstream: str) -> Iterator[_Server]:
    """``libra serve --server upstream`` in a subprocess."""
    root = Path(__file__).resolve().parents[2]
    command = [
        sys.executable, "-m", "libra", "serve", "--server", upstream, "--no-auth",
        "--port", "0", "--no-console", "--scheduler", "least-loaded",
        "--set", "gateway.session_ttl_s=2", "--set", "gateway.sweep_every_s=0.5",
    ]  # fmt: skip
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, (str(root), os.environ.get("PYTHONPATH")))),
    }
    with subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True) as process:
        try:
            assert process.stdout is not None
            line = process.stdout.readline()
            if not line.startswith("libra serve: http://"):
                raise RuntimeError(f"libra serve did not start: {line!r}")
            yield _Server(line.split()[2].removesuffix("/v1"), process.pid)
        finally:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
