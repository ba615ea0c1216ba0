"""Bubblewrap sandboxes, for machines without Docker.

Every :meth:`BwrapSandbox.exec` is one ``bwrap`` process: new user, pid, network, ipc and uts
namespaces (``--unshare-all``; ``--share-net`` only when the spec asks for network), no further
user namespaces inside (``--disable-userns``), a seccomp filter (:mod:`._seccomp`), and a fresh
root holding read-only binds of the image's root filesystem (``$LIBRA_HOME/images/<image>``,
the same one Docker imports) or of the host's ``/usr``, ``/lib*``, ``/bin``, ``/sbin`` and a few
files of ``/etc``, the sandbox's own ``/etc/hostname``, ``/etc/hosts`` and ``/etc/resolv.conf``,
plus ``/proc``, a minimal read-only ``/dev`` with a capped ``/dev/shm``, and the trajectory's
work dir and ``/tmp``. The work dir and ``/tmp`` live in one host directory per trajectory
(size-capped tmpfs mounts when running as root), so files persist across calls; processes do
not (the pid namespace dies with the command), nor do IPC objects (the ipc namespace too).
The directory is removed when the trajectory ends; directories of dead runs are reaped when a
provider starts.

Users and limits. As root, each trajectory runs as an unprivileged host uid of its own (seen as
65534 inside), so files the env writes as root with mode 0o600 stay unreadable to commands,
and in a cgroup of its own (:mod:`._cgroups`) that caps the memory, the processes and the CPU
of all its processes together, as Docker does. Each process is also held by rlimits: address
space (a memory bomb gets ``MemoryError``), processes of its uid, CPU time and file size.
Without root, or where no cgroup can be made, only the rlimits hold: memory is then capped per
process (several processes may together exceed ``spec.memory_mb``) and ``spec.cpus`` is not
enforced; without root, commands also run as the calling user, the work dir has no total size
cap, and mode 0o600 does not hide a file from commands (same uid).

On timeout the whole bwrap process group is killed; ``--die-with-parent`` and the pid namespace
take every process of the command with it. Without ``bwrap`` the provider refuses to run; it
never runs a command unsandboxed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import posixpath
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Literal

import anyio
import anyio.abc
import anyio.to_thread

from libra.envs import ExecResult, SandboxError, SandboxSpec, check_exec_args
from libra.sandbox._beneath import read_beneath, write_beneath
from libra.sandbox._bwrap_command import enter_cgroup_as, limits, mount_args
from libra.sandbox._bwrap_scratch import (
    Scratch,
    make_scratch,
    reap_stale_workdirs,
    remove_scratch,
)
from libra.sandbox._common import CappedOutput
from libra.sandbox._images import rootfs_dir
from libra.sandbox._seccomp import program_fd, seccomp_program

__all__ = ["BwrapSandbox", "BwrapSandboxProvider", "reap_stale_workdirs"]

_log = logging.getLogger(__name__)

INSIDE_UID = 65534  # what commands see as their uid and gid, as in the Docker sandboxes
_KILL_DRAIN_S = 1.0  # after killing a timed-out command, how long its exit may take to show
_SANDBOX_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Printed inside the sandbox before the command runs: stdout that does not start with it means
# bwrap failed to set the sandbox up. What bwrap then writes to stderr ("bwrap: ...") is no
# proof, since the command can print the same and fake a sandbox fault.
_STARTED = b"\0libra-started\0"
_MARK_START = "printf '\\0libra-started\\0'; exec \"$@\""

RootChoice = Literal["auto", "image", "host"] | Path


def _require_tools() -> None:
    tools = [("bwrap", "bubblewrap"), ("prlimit", "util-linux"), ("setpriv", "util-linux")]
    for tool, package in tools:
        if shutil.which(tool) is None:
            raise SandboxError(
                f"`{tool}` is not installed, and Libra never runs commands unsandboxed: "
                f"install it with `apt-get install -y {package}` (or run scripts/ensure-docker.sh "
                "as root), or use DockerSandboxProvider"
            )


# ---------------------------------------------------------------------------------------------
# Sandbox


class BwrapSandbox:
    """A trajectory's bubblewrap sandbox: its files persist across calls, processes do not."""

    def __init__(self, spec: SandboxSpec, scratch: Scratch, host_uid: int | None) -> None:
        self.spec = spec
        self.host_uid = host_uid
        self._scratch = scratch
        self._running = 0  # execs in flight: the pids budget is reset only between them

    @property
    def rootfs(self) -> Path | None:
        """The root filesystem the commands see (None: the host's system dirs)."""
        return self._scratch.rootfs

    async def exec(
        self,
        argv: Sequence[str],
        *,
        timeout_s: float,
        stdin: bytes | None = None,
        workdir: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> ExecResult:
        """Run ``argv`` in a fresh bwrap; on timeout kill it and every process it started."""
        check_exec_args(argv, timeout_s)
        if self._scratch.cgroup is not None and self._running == 0:
            cgroup = self._scratch.cgroup
            await anyio.to_thread.run_sync(cgroup.budget_pids, self.spec.pids + 2)
        self._running += 1
        try:
            return await self._exec(argv, timeout_s, stdin, workdir, env)
        finally:
            self._running -= 1

    async def _exec(
        self,
        argv: Sequence[str],
        timeout_s: float,
        stdin: bytes | None,
        workdir: str | None,
        env: Mapping[str, str] | None,
    ) -> ExecResult:
        program = seccomp_program()
        filter_fd = program_fd(program) if program is not None else None
        try:
            seccomp = ["--seccomp", str(filter_fd)] if filter_fd is not None else []
            command = self._command(argv, timeout_s, workdir, env or {}, seccomp)
            return await self._run(command, timeout_s, stdin, filter_fd)
        finally:
            if filter_fd is not None:
                os.close(filter_fd)

    async def write_file(self, path: str, data: bytes, *, mode: int = 0o644) -> None:
        """Write ``data`` (owned by the env's user, with ``mode``) under the work dir or /tmp."""
        root, parts = self._host_location(path)
        try:
            await anyio.to_thread.run_sync(write_beneath, root, parts, data, mode & 0o7777)
        except OSError as error:
            raise SandboxError(f"cannot write {path!r} in the sandbox: {error}") from error

    async def read_file(self, path: str) -> bytes:
        """The bytes of a file under the work dir or /tmp (symlinks are refused)."""
        root, parts = self._host_location(path)
        try:
            return await anyio.to_thread.run_sync(read_beneath, root, parts)
        except FileNotFoundError:
            raise FileNotFoundError(path) from None
        except OSError as error:
            raise SandboxError(f"cannot read {path!r} from the sandbox: {error}") from error

    def _host_location(self, path: str) -> tuple[Path, list[str]]:
        """The host directory and path parts behind a sandbox path (work dir or /tmp only)."""
        absolute = posixpath.normpath(posixpath.join(self.spec.workdir, path))
        for inside, host in ((self.spec.workdir, self._scratch.work), ("/tmp", self._scratch.tmp)):
            relative = posixpath.relpath(absolute, posixpath.normpath(inside))
            if relative not in (".", "..") and not relative.startswith("../"):
                return host, relative.split("/")
        raise SandboxError(
            f"{path!r}: bwrap sandboxes read and write files only under {self.spec.workdir} or /tmp"
        )

    def _command(
        self,
        argv: Sequence[str],
        timeout_s: float,
        workdir: str | None,
        env: Mapping[str, str],
        seccomp_args: Sequence[str] = (),
    ) -> list[str]:
        spec = self.spec
        variables = {"PATH": _SANDBOX_PATH, "HOME": "/tmp", "LANG": "C.UTF-8", "USER": "nobody"}
        variables |= dict(spec.env) | dict(env)
        network = ["--share-net"] if spec.network else []
        identity = ["--uid", str(INSIDE_UID), "--gid", str(INSIDE_UID), "--hostname", "sandbox"]
        # No user namespaces inside (`unshare -r` and friends), and the seccomp filter.
        kernel = ["--unshare-user", "--disable-userns", *seccomp_args]
        return [
            *enter_cgroup_as(self.host_uid, self._scratch.cgroup),
            *limits(spec, timeout_s, self.host_uid),
            "bwrap",
            "--unshare-all",
            *network,
            *kernel,
            "--die-with-parent",
            "--new-session",
            *identity,
            *mount_args(self._scratch, spec.workdir, spec.network),
            "--chdir",
            posixpath.normpath(posixpath.join(spec.workdir, workdir or ".")),
            "--clearenv",
            *[arg for key, value in variables.items() for arg in ("--setenv", key, value)],
            "--",
            *["sh", "-c", _MARK_START, "sh", *argv],
        ]

    async def _run(
        self, command: list[str], timeout_s: float, stdin: bytes | None, filter_fd: int | None
    ) -> ExecResult:
        output = CappedOutput(self.spec.output_limit_bytes, stdout_extra=len(_STARTED))
        started = time.monotonic()
        process = await anyio.open_process(
            command,
            stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # its own process group, killed as one on timeout
            env={"PATH": os.environ.get("PATH", _SANDBOX_PATH)},  # no host secrets in bwrap
            pass_fds=[filter_fd] if filter_fd is not None else [],
        )
        try:
            # The pipes reach end of stream once the pid namespace, and with it every process
            # of the command, is gone.
            with anyio.move_on_after(timeout_s) as deadline:
                await _communicate(process, stdin, output)
                await process.wait()
            timed_out = deadline.cancelled_caught
        finally:  # also when the caller is cancelled
            with anyio.CancelScope(shield=True):
                if process.returncode is None:  # once reaped, its pid may name someone else
                    await _kill_sandbox(process)
                await process.aclose()
        return _result(process.returncode, output, timed_out, time.monotonic() - started)


def _result(
    returncode: int | None, output: CappedOutput, timed_out: bool, duration: float
) -> ExecResult:
    stderr = output.stderr.decode(errors="replace")
    started = output.stdout.startswith(_STARTED)
    if not started and not timed_out:
        raise SandboxError(f"bubblewrap could not set up the sandbox: {stderr.strip()}")
    stdout = output.stdout[len(_STARTED) :] if started else output.stdout
    if returncode is None or returncode < 0:  # killed by a signal: report it as a shell does
        returncode = 128 + (-(returncode or 0) or signal.SIGKILL)
    return ExecResult(
        exit_code=returncode,
        stdout=stdout.decode(errors="replace"),
        stderr=stderr,
        timed_out=timed_out,
        truncated=output.truncated,
        duration_s=duration,
    )


async def _communicate(
    process: anyio.abc.Process, stdin: bytes | None, output: CappedOutput
) -> None:
    async with anyio.create_task_group() as group:
        group.start_soon(_drain, process.stdout, 1, output)
        group.start_soon(_drain, process.stderr, 2, output)
        if stdin is not None:
            group.start_soon(_feed, process.stdin, stdin)


async def _drain(
    stream: anyio.abc.ByteReceiveStream | None, number: int, output: CappedOutput
) -> None:
    if stream is None:
        return
    with contextlib.suppress(anyio.EndOfStream, anyio.ClosedResourceError):
        while True:
            output.add(number, await stream.receive())


async def _feed(stream: anyio.abc.ByteSendStream | None, data: bytes) -> None:
    """Send stdin and close it; a command that exits without reading it is no error."""
    if stream is None:
        return
    with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
        await stream.send(data)
        await stream.aclose()


async def _kill_sandbox(process: anyio.abc.Process) -> None:
    """Kill a running command and wait until every process of its pid namespace is gone.

    Killing the namespace's init (bwrap's child) makes the kernel kill and reap everything in
    it before the outer bwrap sees the init exit; killing the outer bwrap first would return
    before that, while the dying processes still count against the uid's process limit.
    """
    for child in _children(process.pid):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(child, signal.SIGKILL)
    with anyio.move_on_after(_KILL_DRAIN_S):
        await process.wait()
    if process.returncode is None:
        _kill_group(process.pid)
        with anyio.move_on_after(_KILL_DRAIN_S):
            await process.wait()


def _children(pid: int) -> list[int]:
    with contextlib.suppress(OSError):
        return [
            int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        ]
    return []


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


# ---------------------------------------------------------------------------------------------
# Provider


class BwrapSandboxProvider:
    """Sandboxes made with bubblewrap (see the module docstring).

    ``root`` picks the root filesystem: "image" the image's directory under ``$LIBRA_HOME``
    (an error when it is not built), "host" the host's system dirs, "auto" the image when it is
    built and the host otherwise, or an explicit directory.
    """

    def __init__(self, *, root: RootChoice = "auto", reap_stale: bool = True) -> None:
        self.root = root
        self._reap_stale = reap_stale
        self._started = False
        self._closed = False
        self._uids_in_use: set[int] = set()
        # Host uids no account uses (a random base: two runs on one host rarely share any).
        self._uid_base = 1_000_000 + secrets.randbelow(1_000_000_000)
        self._open: dict[Path, Scratch] = {}

    async def start(self) -> None:
        """Check the tools and reap directories of dead runs (done once; also done lazily)."""
        if self._closed:
            raise SandboxError("the sandbox provider is closed")
        if self._started:
            return
        _require_tools()
        if self._reap_stale:
            await anyio.to_thread.run_sync(reap_stale_workdirs)
        self._started = True

    async def __aenter__(self) -> BwrapSandboxProvider:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def rootfs_for(self, spec: SandboxSpec) -> Path | None:
        """The root filesystem directory used for ``spec`` (None: the host's system dirs)."""
        if isinstance(self.root, Path):
            return self.root
        if self.root == "host":
            return None
        built = rootfs_dir(spec.image)
        if (built / ".libra-image").is_file():
            return built
        if self.root == "image":
            raise SandboxError(
                f"the root filesystem of {spec.image!r} is not built at {built}; build it with "
                f"`python -m libra.sandbox build-rootfs {spec.image}` (root, debootstrap)"
            )
        return None

    @contextlib.asynccontextmanager
    async def sandbox(self, spec: SandboxSpec) -> AsyncIterator[BwrapSandbox]:
        """A sandbox for one trajectory; its directory is removed on exit."""
        await self.start()
        rootfs = self.rootfs_for(spec)
        with self._host_uid() as host_uid:
            scratch = await anyio.to_thread.run_sync(make_scratch, spec, host_uid, rootfs)
            self._open[scratch.base] = scratch
            try:
                yield BwrapSandbox(spec, scratch, host_uid)
            finally:
                with anyio.CancelScope(shield=True):
                    if self._open.pop(scratch.base, None) is not None:
                        await anyio.to_thread.run_sync(
                            remove_scratch, scratch.base, scratch.mounted, scratch.cgroup
                        )

    @contextlib.contextmanager
    def _host_uid(self) -> Iterator[int | None]:
        """A host uid of its own for the trajectory when running as root, else None."""
        if os.geteuid() != 0:
            yield None
            return
        uid = self._uid_base
        while uid in self._uids_in_use:
            uid += 1
        self._uids_in_use.add(uid)
        try:
            yield uid
        finally:
            self._uids_in_use.discard(uid)

    async def aclose(self) -> None:
        """Remove the directories of sandboxes still open."""
        self._closed = True
        leftovers = list(self._open.values())
        self._open.clear()
        with anyio.CancelScope(shield=True):
            for scratch in leftovers:
                await anyio.to_thread.run_sync(
                    remove_scratch, scratch.base, scratch.mounted, scratch.cgroup
                )
