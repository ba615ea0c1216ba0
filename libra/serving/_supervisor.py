"""Keeping a fleet's own servers serving: a server that dies or hangs leaves routing at
once, is restarted on the same address, is given the weights the run serves now, and
routes again.

A process's exit is seen the moment it happens (a pidfd, not a poll); a hang (alive,
answering nothing) once ``hung_after`` health probes in a row go unanswered, each bounded
by ``probe_timeout_s``, and the hung server is then killed. Either way the calls in flight
on it are cut, and the engine retries them elsewhere with their context and exact tokens
(the live fleet's promise), or waits for an instance when none is left. Restarts back
off; after ``max_restarts`` failed starts in a row the server is removed for good and the
run goes on without it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol, runtime_checkable

import anyio
import anyio.abc
import httpx
from pydantic import Field, PositiveFloat, PositiveInt

from libra.config import Section
from libra.sched import Router
from libra.serving._weight_sync import WeightSync, WeightSyncConfig

log = logging.getLogger(__name__)


class ServerProcess(Protocol):
    """A server the supervisor can restart: a :class:`~libra.serving.VLLMServer`, or the
    emulator's ``EmulatorServer``. A restarted server keeps its URL."""

    @property
    def url(self) -> str: ...

    async def astart(self) -> None: ...

    async def astop(self) -> None: ...

    async def wait_exited(self) -> None: ...


CurrentWeights = Callable[[], tuple[Path | None, int]]
"""The weights the run serves now: an exported folder and its version, or ``(None, v)``
when the servers' start-up weights are current (version ``v``, 0 for a fresh run) or,
for :class:`OnDisk` weights, when version ``v`` was sent without the disk."""


@runtime_checkable
class OnDisk(Protocol):
    """Weights a collective transport sent (no folder holds them): a restarted server,
    outside the transport's group, is given them through a folder written on demand."""

    async def on_disk(self, version: int) -> Path: ...


class SupervisorConfig(Section):
    probe_interval_s: PositiveFloat = Field(2.0, description="seconds between health probes")
    probe_timeout_s: PositiveFloat = Field(5.0, description="a probe unanswered by then missed")
    hung_after: PositiveInt = Field(3, description="missed probes in a row that mean hung")
    max_restarts: PositiveInt = Field(5, description="failed starts in a row before giving up")
    backoff_s: PositiveFloat = Field(1.0, description="wait after a failed start, doubling")
    max_backoff_s: PositiveFloat = Field(
        60.0, description="the longest wait after a failed start: backoff_s doubles up to it"
    )
    calls_wait_s: PositiveFloat = Field(
        900.0,
        description="a call with every server down waits this long for a restart before it "
        "fails (the engine's capacity_wait_s, raised to this for a supervised fleet)",
    )


EventKind = Literal["died", "hung", "restarted", "restart_failed", "gave_up"]


@dataclass(frozen=True, slots=True)
class ServerEvent:
    time: float
    instance: str
    kind: EventKind
    detail: str = ""


class ServerSupervisor:
    """Watches ``servers`` (by their instance names in ``router``) until cancelled."""

    def __init__(
        self,
        router: Router,
        servers: Mapping[str, ServerProcess],
        *,
        weights: CurrentWeights = lambda: (None, 0),
        config: SupervisorConfig | None = None,
        sync: WeightSyncConfig | None = None,
    ) -> None:
        self.router, self.servers, self.weights = router, dict(servers), weights
        self.config = config or SupervisorConfig()
        self.sync = sync
        self.events: list[ServerEvent] = []
        self._watches: dict[str, anyio.CancelScope] = {}
        self._running: tuple[httpx.AsyncClient, anyio.abc.TaskGroup] | None = None

    async def run(self) -> None:
        """Watch every server, and those :meth:`watch` adds, until cancelled."""
        async with (
            httpx.AsyncClient(timeout=self.config.probe_timeout_s) as client,
            anyio.create_task_group() as group,
        ):
            self._running = client, group
            try:
                for name, server in self.servers.items():
                    self._start_watching(name, server)
                await anyio.sleep_forever()
            finally:
                self._running = None

    def watch(self, name: str, server: ServerProcess) -> None:
        """Supervise ``server`` too, from now on (a server started after the run began:
        the allocation pool's)."""
        self.unwatch(name)
        self.servers[name] = server
        if self._running is not None:
            self._start_watching(name, server)

    def unwatch(self, name: str) -> None:
        """Stop supervising ``name``, a restart under way included: its owner is about to
        stop it, and its exit is then no fault."""
        self.servers.pop(name, None)
        scope = self._watches.pop(name, None)
        if scope is not None:
            scope.cancel()

    def _start_watching(self, name: str, server: ServerProcess) -> None:
        assert self._running is not None
        client, group = self._running
        scope = self._watches[name] = anyio.CancelScope()
        group.start_soon(self._watch_within, scope, client, name, server)

    async def _watch_within(
        self, scope: anyio.CancelScope, client: httpx.AsyncClient, name: str, server: ServerProcess
    ) -> None:
        with scope:
            await self._watch(client, name, server)

    async def _watch(self, client: httpx.AsyncClient, name: str, server: ServerProcess) -> None:
        while True:
            kind, detail = await self._until_down(client, server)
            self._record(name, kind, detail)
            self._mark_down(name, True)  # no call goes there from now on
            await server.astop()  # ends a hung one; releases a dead one
            if not await self._restart(name, server):
                if name in self.router.by_name:
                    self.router.remove(name, force=True)
                self._record(name, "gave_up", f"{self.config.max_restarts} failed starts")
                return
            self._mark_down(name, False)  # waiting trajectories wake

    async def _until_down(
        self, client: httpx.AsyncClient, server: ServerProcess
    ) -> tuple[EventKind, str]:
        """Wait for the server's exit or hang, whichever comes first."""
        outcome: list[tuple[EventKind, str]] = []
        async with anyio.create_task_group() as group:

            async def exited() -> None:
                await server.wait_exited()
                outcome.append(("died", "its process exited"))
                group.cancel_scope.cancel()

            async def hung() -> None:
                await self._until_hung(client, server.url)
                config = self.config
                waited = config.hung_after * (config.probe_interval_s + config.probe_timeout_s)
                outcome.append(
                    ("hung", f"{config.hung_after} health probes unanswered (up to {waited:.0f} s)")
                )
                group.cancel_scope.cancel()

            group.start_soon(exited)
            group.start_soon(hung)
        return outcome[0]

    async def _until_hung(self, client: httpx.AsyncClient, url: str) -> None:
        misses = 0
        while misses < self.config.hung_after:
            await anyio.sleep(self.config.probe_interval_s)
            misses = 0 if await _answers(client, url) else misses + 1

    async def _restart(self, name: str, server: ServerProcess) -> bool:
        delay = self.config.backoff_s
        for attempt in range(1, self.config.max_restarts + 1):
            try:
                await server.astart()
                version = await self._load_current_weights(name)
            except Exception as error:  # a start that fails is retried, then given up
                self._record(name, "restart_failed", f"attempt {attempt}: {error!r}"[:500])
                with anyio.CancelScope(shield=True):
                    await server.astop()
                await anyio.sleep(delay)
                delay = min(2 * delay, self.config.max_backoff_s)
                continue
            self._record(name, "restarted", f"attempt {attempt}, weights v{version}")
            return True
        return False

    async def _load_current_weights(self, name: str) -> int:
        """Give the restarted server the run's weights; load again if the run moved on to
        newer ones meanwhile. Returns the version it serves."""
        endpoint = self.router.by_name[name].endpoint
        while True:
            folder, version = self.weights()
            weights: object = self.weights  # any CurrentWeights; some are OnDisk too
            if folder is None and version > 0 and isinstance(weights, OnDisk):
                folder = await weights.on_disk(version)
            if folder is not None:
                await WeightSync([endpoint], self.sync).sync(folder, version)
            endpoint.weight_version = version
            if self.weights()[1] == version:
                return version

    def _mark_down(self, name: str, down: bool) -> None:
        if name in self.router.by_name:
            self.router.mark_down(name, down)

    def _record(self, name: str, kind: EventKind, detail: str) -> None:
        event = ServerEvent(anyio.current_time(), name, kind, detail)
        self.events.append(event)
        level = logging.INFO if kind == "restarted" else logging.WARNING
        log.log(level, "server %s %s: %s", name, kind.replace("_", " "), detail)


async def _answers(client: httpx.AsyncClient, url: str) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        return (await client.get(f"{url}/health")).status_code == 200
    return False
