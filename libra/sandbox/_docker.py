"""Docker sandboxes: a warm pool of locked-down, long-lived containers.

Each :class:`SandboxSpec` maps to a pool of started containers (``sleep infinity`` under
Docker's init). A trajectory borrows one, runs tools in it with ``exec``, and gives it back;
the container is then reset (the sandbox user's processes killed, the work dir, ``/tmp``,
``/dev/shm``, ``/dev/mqueue`` and its System V IPC objects wiped) and reused, or destroyed
and replaced when the reset fails. Processes do not outlive the call that started them:
when no exec of the sandbox is running any more, every process of the sandbox user is
killed (a daemon started by one tool call is gone before the next), as in bubblewrap.

Defaults are the safe ones: no network unless the spec asks, a read-only root with a tmpfs work
dir, all capabilities dropped, ``no-new-privileges``, memory (no swap), CPU and pids limits.

Users. The container's own processes run as root *without capabilities*; commands run as an
unprivileged user (65534 by default), which therefore can neither signal them nor read files
the env wrote as root. Files from :meth:`DockerSandbox.write_file` are owned by root and the
mode says what the sandboxed user may do: 0o644 read, 0o666 read and write, 0o600 nothing (a
hidden unit test). The work dir is root's with mode 1777, like ``/tmp``: the sandboxed user
adds files but cannot delete or replace the env's.

Timeouts. A command runs under ``timeout -s KILL`` inside the container, which kills the
command's whole process group; the host stops waiting ``timeout + 0.5 s`` after the start in
any case, and once no other exec runs kills every process of the sandbox user (descendants
that left the process group, or hold the output pipe, die too). A command that exits while a
background process it started still holds stdout returns after Docker's 2 s output grace;
redirect the output of background processes.

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
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import anyio.to_thread

from libra.envs import ExecResult, SandboxError, SandboxSpec, check_exec_args
from libra.sandbox._common import process_start_time
from libra.sandbox._docker_exec import RawExec, exec_blocking

if TYPE_CHECKING:
    import docker

__all__ = [
    "DockerSandbox",
    "DockerSandboxProvider",
    "PoolStats",
    "connect_docker",
    "reap_stale_containers",
]

T = TypeVar("T")

LABEL_SANDBOX = "libra.sandbox"
LABEL_RUN = "libra.run"
LABEL_PID = "libra.pid"
LABEL_PID_START = "libra.pid_start"
LABEL_HOST = "libra.host"

SANDBOX_USER = "65534:65534"
ROOT_USER = "0:0"
_KILL_GRACE_S = 0.5  # after the in-container timeout fires, time for its output to drain
_READ_FILE_LIMIT = 256 * 1024 * 1024
_TMP_SIZE_MB = 16
_EXIT_MISSING_FILE = 3

# Runs as root (without capabilities) with stdin = the file's bytes. Parent directories made here
# get mode 1777 like the work dir; the temporary file is private until it is renamed in place.
_WRITE_FILE_SCRIPT = """
set -e
mode=$1; target=$2; shift 2
for dir in "$@"; do [ -d "$dir" ] || mkdir -m 1777 -- "$dir"; done
umask 077
tmp=$(mktemp -- "$target.libra-XXXXXX")
cat > "$tmp"
chmod "$mode" -- "$tmp"
mv -f -- "$tmp" "$target"
"""

# A command under `timeout`, then whether any other process of the sandbox user is left (a
# /proc entry it owns), told after all of its output, at the very end of stderr, where the
# command cannot write after it. Most commands leave nothing, which spares the extra exec that
# kills leftovers.
_LEFTOVERS_MARK = b"\0libra-leftovers="
_RUN_AND_LOOK_FOR_LEFTOVERS = """
limit=$1; shift
timeout -s KILL "$limit" "$@"; status=$?
left=0
for p in /proc/[0-9]*; do
  if [ "$p" != "/proc/$$" ] && [ -O "$p" ]; then left=1; break; fi
done
printf '\\0libra-leftovers=%s' "$left" >&2
exit $status
"""


def _leftovers_of(raw: RawExec) -> bool:
    """Whether the command may have left processes: True unless the check's "none" ends the
    whole stderr. Only a leftover could write after the check, and the check then said "some",
    which no later write can hide; a cut stream may have lost the verdict."""
    said_none = raw.stderr.endswith(_LEFTOVERS_MARK + b"0")
    return raw.truncated or not said_none or _LEFTOVERS_MARK + b"1" in raw.stderr


def _without_leftovers_mark(stderr: bytes) -> bytes:
    for verdict in (b"0", b"1"):
        if stderr.endswith(_LEFTOVERS_MARK + verdict):
            return stderr[: -len(_LEFTOVERS_MARK) - 1]
    return stderr


_READ_FILE_SCRIPT = f'[ -e "$1" ] || exit {_EXIT_MISSING_FILE}; exec cat -- "$1"'

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


# ---------------------------------------------------------------------------------------------
# Sandbox


class DockerEngineUnreachable(SandboxError):
    """The Docker engine does not answer (stopped, restarting): no container can start."""


class DockerSandbox:
    """One pooled container lent to one trajectory (see the module docstring for the rules)."""

    def __init__(self, provider: DockerSandboxProvider, container_id: str, spec: SandboxSpec):
        self._provider = provider
        self.container_id = container_id
        self.spec = spec
        self._running = 0  # execs in flight
        self._maybe_leftovers = False  # an exec may have left processes of the sandbox user
        self._sweeping = anyio.Lock()  # no exec starts while leftovers are being killed

    async def exec(
        self,
        argv: Sequence[str],
        *,
        timeout_s: float,
        stdin: bytes | None = None,
        workdir: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> ExecResult:
        """Run ``argv`` as the sandbox user; on timeout kill its process tree."""
        check_exec_args(argv, timeout_s)
        cmd = ["sh", "-c", _RUN_AND_LOOK_FOR_LEFTOVERS, "sh", f"{timeout_s:.3f}", *argv]
        limit = self.spec.output_limit_bytes
        async with self._sweeping:
            self._running += 1
        started = time.monotonic()
        raw: RawExec | None = None
        try:
            raw = await self._run(
                cmd,
                user=self._provider.user,
                stdin=stdin,
                workdir=self._absolute(workdir or self.spec.workdir),
                env=env or {},
                output_limit=limit + len(_LEFTOVERS_MARK) + 1,
                deadline=started + timeout_s + _KILL_GRACE_S,
            )
        finally:
            self._running -= 1
            self._maybe_leftovers |= raw is None or raw.deadline_hit or _leftovers_of(raw)
            with anyio.CancelScope(shield=True):
                await self._kill_leftovers()
        duration = time.monotonic() - started
        if raw.exit_code in (None, 137) and not raw.deadline_hit:
            await self._check_alive()  # a killed command, or a killed container?
        timed_out = raw.deadline_hit or (raw.exit_code == 137 and duration >= timeout_s)
        stderr = _without_leftovers_mark(raw.stderr)
        return ExecResult(
            exit_code=137 if raw.exit_code is None else raw.exit_code,
            stdout=raw.stdout[:limit].decode(errors="replace"),
            stderr=stderr[:limit].decode(errors="replace"),
            timed_out=timed_out,
            truncated=raw.truncated or len(raw.stdout) > limit or len(stderr) > limit,
            duration_s=duration,
        )

    async def write_file(self, path: str, data: bytes, *, mode: int = 0o644) -> None:
        """Write ``data`` as a root-owned file with ``mode`` (0o600 hides it from commands)."""
        target = self._absolute(path)
        parents = _missing_parent_candidates(target, self.spec.workdir)
        raw = await self._run(
            ["sh", "-c", _WRITE_FILE_SCRIPT, "sh", f"{mode & 0o7777:o}", target, *parents],
            user=ROOT_USER,
            stdin=data,
            workdir="/",
            env={},
            output_limit=4096,
            deadline=time.monotonic() + 60.0,
        )
        if raw.exit_code != 0:
            detail = raw.stderr.decode(errors="replace").strip()
            raise SandboxError(f"cannot write {target} in the sandbox: {detail or raw.exit_code}")

    async def read_file(self, path: str) -> bytes:
        """The bytes of ``path``, read as root, or as the sandbox user for its private files."""
        target = self._absolute(path)
        raw: RawExec | None = None
        for user in (ROOT_USER, self._provider.user):
            raw = await self._run(
                ["sh", "-c", _READ_FILE_SCRIPT, "sh", target],
                user=user,
                stdin=None,
                workdir="/",
                env={},
                output_limit=_READ_FILE_LIMIT,
                deadline=time.monotonic() + 60.0,
            )
            if raw.exit_code == _EXIT_MISSING_FILE:
                raise FileNotFoundError(target)
            if raw.exit_code == 0 and not raw.truncated:
                return raw.stdout
        assert raw is not None
        detail = raw.stderr.decode(errors="replace").strip()
        raise SandboxError(f"cannot read {target} from the sandbox: {detail or raw.exit_code}")

    async def _check_alive(self) -> None:
        """A container that stopped under a command is the sandbox's failure, not the
        command's (an out-of-memory kill inside a running container is the command's)."""
        if not await self._provider.is_running(self.container_id):
            raise SandboxError(
                "the sandbox's container died during the call "
                f"({self.container_id[:12]} stopped: killed, or its engine restarted)"
            )

    async def _kill_leftovers(self) -> None:
        """Once no exec runs, kill what the last ones may have left (daemons, background
        jobs): every process of the sandbox user."""
        async with self._sweeping:
            if self._running == 0 and self._maybe_leftovers:
                await self._provider.kill_sandbox_processes(self.container_id)
                self._maybe_leftovers = False

    def _absolute(self, path: str) -> str:
        """``path`` made absolute: relative paths are under the work dir."""
        return posixpath.normpath(posixpath.join(self.spec.workdir, path))

    async def _run(self, cmd: Sequence[str], **kwargs: Any) -> RawExec:
        call = functools.partial(
            exec_blocking, self._provider.api, self.container_id, cmd, **kwargs
        )
        return await self._provider.call_in_thread(call, abandon_on_cancel=True)


def _missing_parent_candidates(target: str, workdir: str) -> list[str]:
    """Directories between the work dir (or /) and ``target``, outermost first."""
    parents: list[str] = []
    directory = posixpath.dirname(target)
    stop = {"/", posixpath.normpath(workdir)}
    while directory not in stop:
        parents.append(directory)
        directory = posixpath.dirname(directory)
    return parents[::-1]


# ---------------------------------------------------------------------------------------------
# Provider and pool


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


@dataclass(slots=True)
class PoolStats:
    """Counters of a provider's pool, for benchmarks and tests."""

    created: int = 0
    reused: int = 0
    destroyed: int = 0
    reset_failures: int = 0
    dead_on_handout: int = 0  # idle containers found stopped (a daemon restart, a kill)


class DockerSandboxProvider:
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
        self.pool_size = pool_size
        self.user = user
        self.run_id = run_id or uuid.uuid4().hex[:12]
        self.runtime = runtime
        self.engine_wait_s = engine_wait_s
        self.stats = PoolStats()
        self._network = network
        self._reap_stale = reap_stale
        self._client = client
        self._limiter = anyio.CapacityLimiter(max_threads)
        self._start_lock = anyio.Lock()
        self._started = False
        self._closed = False
        self._idle: dict[_PoolKey, list[str]] = {}
        self._live: set[str] = set()
        self._serial = 0

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

    def _remove_unknown_of_run(self) -> None:
        label = f"{LABEL_RUN}={self.run_id}"
        for container in self.client.containers.list(all=True, filters={"label": label}):
            self._destroy_blocking(container.id)

    @property
    def client(self) -> docker.DockerClient:
        if self._client is None:
            raise SandboxError("the provider has not started; call `await provider.start()`")
        return self._client

    @property
    def api(self) -> docker.APIClient:
        return self.client.api

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
            if await self.is_running(container_id):
                self.stats.reused += 1
                return container_id
            self.stats.dead_on_handout += 1
            await self._destroy(container_id)
        return await self._create(spec)

    async def is_running(self, container_id: str) -> bool:
        """Whether the container is up (False when it is gone)."""
        return await self.call_in_thread(functools.partial(self._is_running_blocking, container_id))

    def _is_running_blocking(self, container_id: str) -> bool:
        import docker.errors

        try:
            return bool(self.api.inspect_container(container_id)["State"]["Running"])
        except docker.errors.NotFound:
            return False

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

    # -- container operations -----------------------------------------------------------------

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
        """A new container; while the Docker engine is unreachable (restarting), wait for it
        up to ``engine_wait_s`` rather than fail every trajectory that starts meanwhile."""
        deadline = anyio.current_time() + self.engine_wait_s
        delay = 0.5
        while True:
            try:
                return await self._create_once(spec)
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
