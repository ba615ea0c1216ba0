"""Docker containers for sandboxes: the engine's connection, the locked-down container (its
security settings), creation, reset and destruction, and reaping the stale ones of dead runs.

Defaults are the safe ones: no network unless the spec asks, a read-only root with a tmpfs work
dir, all capabilities dropped, ``no-new-privileges``, memory (no swap), CPU and pids limits.

Images need ``sh``, ``sleep``, ``find``, coreutils' ``timeout`` and util-linux's ``ipcrm``
(``libra/python`` has them; without ``ipcrm`` a container that made IPC objects is replaced
rather than reused).
"""

from __future__ import annotations

import contextlib
import functools
import os
import posixpath
import socket
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import anyio.to_thread

from libra.envs import SandboxError, SandboxSpec
from libra.sandbox._common import process_start_time
from libra.sandbox._docker_exec import RawExec, exec_blocking

if TYPE_CHECKING:
    import docker

T = TypeVar("T")

LABEL_SANDBOX = "libra.sandbox"
LABEL_RUN = "libra.run"
LABEL_PID = "libra.pid"
LABEL_PID_START = "libra.pid_start"
LABEL_HOST = "libra.host"

SANDBOX_USER = "65534:65534"
ROOT_USER = "0:0"
_TMP_SIZE_MB = 16

# First pass, as the sandbox user: kill all its processes (twice: a fork in flight may escape
# the first sweep), remove its System V IPC objects (they outlive every process, pass data to
# the next trajectory and count against its memory), make its own files deletable, delete them.
_RESET_AS_SANDBOX_USER = """
kill -9 -1 2>/dev/null; kill -9 -1 2>/dev/null
command -v ipcrm >/dev/null && ipcrm --all 2>/dev/null
for dir in "$@"; do
  chmod -R u+rwX -- "$dir" 2>/dev/null
  find "$dir" -mindepth 1 -delete 2>/dev/null
done
exit 0
"""

# Second pass, as root: delete the env's files; fail unless every directory is empty now and
# no System V IPC object is left (each table has a header line only).
_RESET_AS_ROOT = """
for dir in "$@"; do find "$dir" -mindepth 1 -delete 2>/dev/null; done
for dir in "$@"; do
  if [ -n "$(find "$dir" -mindepth 1 -print 2>/dev/null | head -n 1)" ]; then exit 1; fi
done
for table in /proc/sysvipc/shm /proc/sysvipc/msg /proc/sysvipc/sem; do
  if [ -e "$table" ] && [ "$(wc -l < "$table")" -gt 1 ]; then exit 1; fi
done
exit 0
"""


def connect_docker(*, timeout_s: float = 120.0, max_pool_size: int = 64) -> docker.DockerClient:
    """A Docker client for the engine of ``DOCKER_HOST`` (or the local socket), checked alive."""
    try:
        import docker
        import docker.errors
    except ImportError as missing:
        raise SandboxError(
            "the Docker SDK is not installed: pip install 'libra[sandbox]' (or `docker`)"
        ) from missing
    try:
        client = docker.from_env(timeout=round(timeout_s), max_pool_size=max_pool_size)
        client.ping()
    except docker.errors.DockerException as error:
        raise SandboxError(
            f"no Docker engine is reachable ({error}); start one with scripts/ensure-docker.sh "
            "(as root), or use libra.sandbox.BwrapSandboxProvider"
        ) from error
    return client


# ---------------------------------------------------------------------------------------------
# Reaper


def reap_stale_containers(client: docker.DockerClient | None = None) -> list[str]:
    """Remove Libra's sandbox containers whose owner process is gone; return their ids.

    A container is stale when it was made on this host (its ``libra.host`` label) by a process
    that no longer exists, or whose pid now belongs to a newer process (``libra.pid_start``).
    Containers of other hosts sharing the engine, or without an owner label, are left alone.
    """
    client = client or connect_docker()
    found = client.containers.list(all=True, filters={"label": f"{LABEL_SANDBOX}=1"})
    reaped: list[str] = []
    for container in found:
        if _owner_alive(container.labels):
            continue
        with contextlib.suppress(Exception):  # already gone, or being removed by someone else
            container.remove(force=True)
            reaped.append(container.id)
    return reaped


def _owner_alive(labels: Mapping[str, str]) -> bool:
    if labels.get(LABEL_HOST, socket.gethostname()) != socket.gethostname():
        return True
    try:
        pid = int(labels[LABEL_PID])
    except (KeyError, ValueError):
        return True
    started = process_start_time(pid)
    if started is None:
        return False
    recorded = labels.get(LABEL_PID_START)
    return not recorded or not started or recorded == started  # unknown start time: alive


def _owner_labels(run_id: str) -> dict[str, str]:
    pid = os.getpid()
    return {
        LABEL_SANDBOX: "1",
        LABEL_RUN: run_id,
        LABEL_PID: str(pid),
        LABEL_PID_START: process_start_time(pid) or "",
        LABEL_HOST: socket.gethostname(),
    }


class DockerEngineUnreachable(SandboxError):
    """The Docker engine does not answer (stopped, restarting): no container can start."""


@dataclass(slots=True)
class PoolStats:
    """Counters of a provider's pool, for benchmarks and tests."""

    created: int = 0
    reused: int = 0
    destroyed: int = 0
    reset_failures: int = 0
    dead_on_handout: int = 0  # idle containers found stopped (a daemon restart, a kill)


class DockerContainers:
    """One run's containers on a Docker engine: made, reset and removed in worker threads.
    The pool (:class:`~libra.sandbox.DockerSandboxProvider`) lends them."""

    def __init__(
        self,
        *,
        user: str,
        run_id: str | None,
        network: str | None,
        runtime: str | None,
        max_threads: int,
        engine_wait_s: float,
        client: docker.DockerClient | None,
    ) -> None:
        self.user = user
        self.run_id = run_id or uuid.uuid4().hex[:12]
        self.runtime = runtime
        self.engine_wait_s = engine_wait_s
        self.stats = PoolStats()
        self._network = network
        self._client = client
        self._limiter = anyio.CapacityLimiter(max_threads)
        self._closed = False
        self._live: set[str] = set()
        self._serial = 0

    @property
    def client(self) -> docker.DockerClient:
        if self._client is None:
            raise SandboxError("the provider has not started; call `await provider.start()`")
        return self._client

    @property
    def api(self) -> docker.APIClient:
        return self.client.api

    async def is_running(self, container_id: str) -> bool:
        """Whether the container is up (False when it is gone)."""
        return await self.call_in_thread(functools.partial(self._is_running_blocking, container_id))

    def _is_running_blocking(self, container_id: str) -> bool:
        import docker.errors

        try:
            return bool(self.api.inspect_container(container_id)["State"]["Running"])
        except docker.errors.NotFound:
            return False

    def _remove_unknown_of_run(self) -> None:
        label = f"{LABEL_RUN}={self.run_id}"
        for container in self.client.containers.list(all=True, filters={"label": label}):
            self._destroy_blocking(container.id)

    async def call_in_thread(self, call: Callable[[], T], *, abandon_on_cancel: bool = False) -> T:
        """Run a blocking SDK call in a worker thread, turning engine errors into SandboxError."""
        import docker.errors
        import requests

        try:
            return await anyio.to_thread.run_sync(
                call, abandon_on_cancel=abandon_on_cancel, limiter=self._limiter
            )
        except requests.ConnectionError as error:
            raise DockerEngineUnreachable(f"Docker engine unreachable: {error}") from error
        except (docker.errors.DockerException, requests.RequestException) as error:
            raise SandboxError(f"Docker engine error: {error}") from error

    async def _create(self, spec: SandboxSpec) -> str:
        """A new container (waiting for an engine that is restarting)."""
        return await self.engine_waited(functools.partial(self._create_once, spec))

    async def engine_waited(self, call: Callable[[], Awaitable[T]]) -> T:
        """``call()``; while the Docker engine is unreachable (restarting), tried again for
        up to ``engine_wait_s`` rather than fail every trajectory that starts meanwhile."""
        deadline = anyio.current_time() + self.engine_wait_s
        delay = 0.5
        while True:
            try:
                return await call()
            except DockerEngineUnreachable:
                if anyio.current_time() + delay > deadline:
                    raise
                await anyio.sleep(delay)
                delay = min(2 * delay, 5.0)

    async def _create_once(self, spec: SandboxSpec) -> str:
        self._serial += 1
        name = f"libra-{self.run_id}-{self._serial}"
        container_id = await self.call_in_thread(
            functools.partial(self._create_blocking, spec, name)
        )
        self.stats.created += 1
        if self._closed:  # closed while it was starting: aclose() did not see it
            await self._destroy(container_id)
            raise SandboxError("the sandbox provider is closed")
        return container_id

    def _create_blocking(self, spec: SandboxSpec, name: str) -> str:
        import docker.errors

        try:
            # create + start rather than run: run would try to pull a missing image.
            container = self.client.containers.create(name=name, **self._container_config(spec))
            self._live.add(container.id)
            container.start()
        except docker.errors.ImageNotFound as missing:
            raise SandboxError(
                f"sandbox image {spec.image!r} is not in Docker ({missing.explanation}); build it "
                f"with `python -m libra.sandbox build-image {spec.image}` "
                "(or libra.sandbox.build_image())"
            ) from missing
        except docker.errors.APIError as error:
            self._destroy_named(name)
            raise SandboxError(f"cannot start a sandbox from {spec.image!r}: {error}") from error
        except BaseException:  # a request that timed out may have created it all the same
            self._destroy_named(name)
            raise
        container.reload()
        if container.status != "running":
            logs = container.logs(tail=20).decode(errors="replace")
            self._destroy_blocking(container.id)
            raise SandboxError(
                f"sandbox container from {spec.image!r} exited at start ({container.status}): "
                f"{logs.strip()}"
            )
        return str(container.id)

    def _container_config(self, spec: SandboxSpec) -> dict[str, Any]:
        memory = f"{spec.memory_mb}m"
        config: dict[str, Any] = {
            "image": spec.image,
            "entrypoint": ["sleep", "infinity"],
            "init": True,
            "user": ROOT_USER,  # keep-alive processes: root, but with no capabilities
            "network_mode": self._network if spec.network else "none",
            "read_only": True,
            "tmpfs": {
                spec.workdir: f"size={spec.workdir_size_mb}m,mode=1777,exec",
                "/tmp": f"size={_TMP_SIZE_MB}m,mode=1777,exec",
            },
            "cap_drop": ["ALL"],
            "security_opt": ["no-new-privileges"],
            "mem_limit": memory,
            "memswap_limit": memory,
            "nano_cpus": int(spec.cpus * 1e9),
            "pids_limit": spec.pids,
            # No working_dir: Docker would recreate the tmpfs work dir and drop its mode=1777.
            "environment": {"HOME": "/tmp", **spec.env},
            "labels": _owner_labels(self.run_id),
            "hostname": "sandbox",
            "ipc_mode": "private",  # an IPC namespace of its own, which no other can join
        }
        if self.runtime:
            config["runtime"] = self.runtime
        return config

    def _default_network(self) -> str:
        return "bridge" if self.client.networks.list(names=["bridge"]) else "host"

    async def _reset(self, container_id: str, spec: SandboxSpec) -> bool:
        """Make a used container like new; False when that could not be verified."""
        dirs = [posixpath.normpath(spec.workdir), "/tmp", "/dev/shm", "/dev/mqueue"]
        try:
            for user, script in ((self.user, _RESET_AS_SANDBOX_USER), (ROOT_USER, _RESET_AS_ROOT)):
                raw = await self._exec_plain(
                    container_id, ["sh", "-c", script, "sh", *dirs], user, 30.0
                )
                if raw.exit_code != 0:
                    return False
        except SandboxError:
            return False
        return True

    async def kill_sandbox_processes(self, container_id: str) -> None:
        """Kill every process of the sandbox user (after a timeout that outlived its group)."""
        with contextlib.suppress(SandboxError):
            await self._exec_plain(container_id, ["sh", "-c", "kill -9 -1"], self.user, 5.0)

    async def _exec_plain(
        self, container_id: str, cmd: list[str], user: str, limit_s: float
    ) -> RawExec:
        call = functools.partial(
            exec_blocking,
            self.api,
            container_id,
            cmd,
            user=user,
            workdir="/",
            env={},
            stdin=None,
            output_limit=4096,
            deadline=time.monotonic() + limit_s,
        )
        return await self.call_in_thread(call, abandon_on_cancel=True)

    async def _destroy(self, container_id: str) -> None:
        with contextlib.suppress(SandboxError):
            await self.call_in_thread(functools.partial(self._destroy_blocking, container_id))

    def _destroy_named(self, name: str) -> None:
        """Remove a container that was created but could not start (if the engine answers:
        else :meth:`aclose` or the next run's reaper finds it by its labels)."""
        import docker.errors
        import requests

        with contextlib.suppress(docker.errors.DockerException, requests.RequestException):
            container_id = self.api.inspect_container(name)["Id"]
            self._destroy_blocking(container_id)

    def _destroy_blocking(self, container_id: str) -> None:
        import docker.errors

        with contextlib.suppress(docker.errors.NotFound):
            self.api.remove_container(container_id, force=True, v=True)
        if container_id in self._live:
            self._live.discard(container_id)
            self.stats.destroyed += 1
