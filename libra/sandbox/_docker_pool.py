"""Docker sandboxes: a warm pool of locked-down, long-lived containers.

Each :class:`SandboxSpec` maps to a pool of started containers (``sleep infinity`` under
Docker's init). A trajectory borrows one, runs tools in it with ``exec``, and gives it back;
the container is then reset (the sandbox user's processes killed, the work dir, ``/tmp``,
``/dev/shm``, ``/dev/mqueue`` and its System V IPC objects wiped) and reused, or destroyed
and replaced when the reset fails. The containers are :mod:`._docker_container`'s, and
what a trajectory may do in one is :mod:`._docker_sandbox`'s.
"""

from __future__ import annotations

import contextlib
import functools
import posixpath
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import anyio

from libra.envs import SandboxError, SandboxSpec
from libra.sandbox._docker_container import (
    SANDBOX_USER,
    DockerContainers,
    connect_docker,
    reap_stale_containers,
)
from libra.sandbox._docker_sandbox import DockerSandbox

if TYPE_CHECKING:
    import docker


@dataclass(frozen=True, slots=True)
class _PoolKey:
    """The part of a spec that shapes the container (exec-time settings are left out)."""

    image: str
    network: bool
    memory_mb: int
    cpus: float
    pids: int
    workdir: str
    workdir_size_mb: int
    env: tuple[tuple[str, str], ...]

    @classmethod
    def of(cls, spec: SandboxSpec) -> _PoolKey:
        return cls(
            spec.image,
            spec.network,
            spec.memory_mb,
            spec.cpus,
            spec.pids,
            posixpath.normpath(spec.workdir),
            spec.workdir_size_mb,
            tuple(sorted(spec.env.items())),
        )


class DockerSandboxProvider(DockerContainers):
    """Sandboxes as Docker containers from per-spec warm pools.

    ``pool_size`` is the most idle containers kept per spec (0: a fresh container for every
    trajectory). ``network`` is the Docker network given to specs with ``network=True``; by
    default "bridge" when the engine has it, else "host" (an engine started with
    ``--bridge=none``). The provider reaps stale containers of dead runs when it starts.
    An idle container is checked when handed out (one stopped by a daemon restart or a
    kill is replaced), and a new one waits up to ``engine_wait_s`` for an engine that is
    restarting.
    """

    def __init__(
        self,
        *,
        pool_size: int = 8,
        user: str = SANDBOX_USER,
        run_id: str | None = None,
        network: str | None = None,
        runtime: str | None = None,
        reap_stale: bool = True,
        max_threads: int = 64,
        engine_wait_s: float = 60.0,
        client: docker.DockerClient | None = None,
    ) -> None:
        if pool_size < 0:
            raise ValueError("pool_size must be >= 0")
        super().__init__(
            user=user,
            run_id=run_id,
            network=network,
            runtime=runtime,
            max_threads=max_threads,
            engine_wait_s=engine_wait_s,
            client=client,
        )
        self.pool_size = pool_size
        self._reap_stale = reap_stale
        self._start_lock = anyio.Lock()
        self._started = False
        self._idle: dict[_PoolKey, list[str]] = {}

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        """Connect to the engine and reap stale containers (done once; also done lazily)."""
        async with self._start_lock:
            if self._started:
                return
            if self._closed:
                raise SandboxError("the sandbox provider is closed")
            if self._client is None:
                self._client = await self.call_in_thread(connect_docker)
            if self._reap_stale:
                await self.call_in_thread(functools.partial(reap_stale_containers, self._client))
            if self._network is None:
                self._network = await self.call_in_thread(self._default_network)
            self._started = True

    async def __aenter__(self) -> DockerSandboxProvider:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Remove every container of this provider, idle or lent, and any of its run that
        it never learned about (created by a request that timed out on our side)."""
        self._closed = True
        doomed = list(self._live)
        self._idle.clear()
        with anyio.CancelScope(shield=True):
            async with anyio.create_task_group() as group:
                for container_id in doomed:
                    group.start_soon(self._destroy, container_id)
            if self._client is not None:
                with contextlib.suppress(SandboxError):
                    await self.call_in_thread(self._remove_unknown_of_run)

    # -- lending ----------------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def sandbox(self, spec: SandboxSpec) -> AsyncIterator[DockerSandbox]:
        """A container for one trajectory; reset into the pool (or destroyed) on exit."""
        await self.start()
        container_id = await self._acquire(spec)
        try:
            yield DockerSandbox(self, container_id, spec)
        finally:
            with anyio.CancelScope(shield=True):
                await self._release(spec, container_id)

    async def prewarm(self, spec: SandboxSpec, count: int) -> None:
        """Start containers for ``spec`` until ``count`` of them are idle (at most pool_size)."""
        await self.start()
        idle = self._idle.setdefault(_PoolKey.of(spec), [])
        missing = min(count, self.pool_size) - len(idle)

        async def add_one() -> None:
            idle.append(await self._create(spec))

        async with anyio.create_task_group() as group:
            for _ in range(max(missing, 0)):
                group.start_soon(add_one)

    def idle_count(self, spec: SandboxSpec) -> int:
        return len(self._idle.get(_PoolKey.of(spec), []))

    async def _acquire(self, spec: SandboxSpec) -> str:
        idle = self._idle.get(_PoolKey.of(spec))
        while idle:
            container_id = idle.pop()
            # An engine restarting now is waited for, as a new container's is.
            if await self.engine_waited(functools.partial(self.is_running, container_id)):
                self.stats.reused += 1
                return container_id
            self.stats.dead_on_handout += 1
            await self._destroy(container_id)
        return await self._create(spec)

    async def _release(self, spec: SandboxSpec, container_id: str) -> None:
        idle = self._idle.setdefault(_PoolKey.of(spec), [])
        if self._closed or len(idle) >= self.pool_size or container_id not in self._live:
            await self._destroy(container_id)
            return
        if await self._reset(container_id, spec):
            # Others may have filled the pool, or closed the provider, during the reset.
            if self._closed or len(idle) >= self.pool_size:
                await self._destroy(container_id)
            else:
                idle.append(container_id)
            return
        self.stats.reset_failures += 1
        await self._destroy(container_id)
        with contextlib.suppress(SandboxError):  # the replacement is a convenience, not a need
            await self._add_replacement(spec, idle)

    async def _add_replacement(self, spec: SandboxSpec, idle: list[str]) -> None:
        replacement = await self._create(spec)
        if self._closed:  # closed while the replacement was starting
            await self._destroy(replacement)
        else:
            idle.append(replacement)
