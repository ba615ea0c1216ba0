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
import math
import os
import posixpath
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import anyio
import anyio.abc
import anyio.to_thread

from libra.envs import ExecResult, SandboxError, SandboxSpec, check_exec_args
from libra.sandbox._beneath import read_beneath, write_beneath
from libra.sandbox._cgroups import SandboxCgroup, create_cgroup, stale_cgroup_dirs
from libra.sandbox._common import CappedOutput, process_start_time
from libra.sandbox._images import rootfs_dir
from libra.sandbox._seccomp import program_fd, seccomp_program

__all__ = ["BwrapSandbox", "BwrapSandboxProvider", "reap_stale_workdirs"]

_log = logging.getLogger(__name__)

INSIDE_UID = 65534  # what commands see as their uid and gid, as in the Docker sandboxes
_TMP_SIZE_MB = 16  # /tmp, and /dev/shm
_BASE_SIZE_MB = 1  # the trajectory directory itself: mount points and the identity files
_KILL_DRAIN_S = 1.0  # after killing a timed-out command, how long its exit may take to show
_SANDBOX_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Printed inside the sandbox before the command runs: stdout that does not start with it means
# bwrap failed to set the sandbox up. What bwrap then writes to stderr ("bwrap: ...") is no
# proof, since the command can print the same and fake a sandbox fault.
_STARTED = b"\0libra-started\0"
_MARK_START = "printf '\\0libra-started\\0'; exec \"$@\""

# Top-level entries of a root filesystem that commands need; anything else stays invisible.
_SYSTEM_DIRS = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32")
# From the host's /etc only what programs need to start (no secrets; the host's name, hosts
# and resolver are replaced by the sandbox's own: see _IDENTITY).
_HOST_ETC_FILES = (
    "passwd",
    "group",
    "nsswitch.conf",
    "host.conf",
    "ld.so.cache",
    "ld.so.conf",
    "ld.so.conf.d",
    "localtime",
    "alternatives",
    "ssl",
    "ca-certificates",
)

# The sandbox's own /etc/hostname and /etc/hosts; /etc/resolv.conf is empty without network
# and the host's with it (the command then shares the host's network).
_IDENTITY = {
    "hostname": "sandbox\n",
    "hosts": "127.0.0.1\tlocalhost\n127.0.1.1\tsandbox\n::1\tlocalhost\n",
    "resolv.conf": "",
}

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


def _workdirs_parent() -> Path:
    """Where trajectory directories live: traversable (bwrap resolves bind paths as the
    sandbox uid) but not listable."""
    parent = Path(tempfile.gettempdir()) / f"libra-bwrap-{os.geteuid()}"
    parent.mkdir(mode=0o711, exist_ok=True)
    os.chmod(parent, 0o711)
    return parent


# ---------------------------------------------------------------------------------------------
# Per-trajectory host directory


@dataclass(frozen=True, slots=True)
class _Scratch:
    """A trajectory's host directory: ``work`` and ``tmp`` are bound into every command, and
    ``rootfs`` (when set) is a bind of the image's root filesystem that the sandbox uid can
    reach (the image itself may lie under a root-only home). ``cgroup`` holds all the
    trajectory's processes (None where cgroups cannot be made: see the README)."""

    base: Path
    mounted: bool
    rootfs: Path | None
    cgroup: SandboxCgroup | None = None

    @property
    def work(self) -> Path:
        return self.base / "work"

    @property
    def tmp(self) -> Path:
        return self.base / "tmp"


def _make_scratch(spec: SandboxSpec, host_uid: int | None, rootfs: Path | None) -> _Scratch:
    pid = os.getpid()
    base = _workdirs_parent() / f"{pid}-{process_start_time(pid)}-{secrets.token_hex(4)}"
    base.mkdir(mode=0o700)
    mounted = False
    cgroup = None
    try:
        if host_uid is not None:
            mounted = _mount_tmpfs(base, _BASE_SIZE_MB)
            # Only root and the trajectory's own uid (through its group) may pass through.
            os.chown(base, 0, host_uid)
            os.chmod(base, 0o710)
        for sub, size_mb in (("work", spec.workdir_size_mb), ("tmp", _TMP_SIZE_MB)):
            (base / sub).mkdir()
            if mounted:  # each its own cap, as Docker's two tmpfs mounts
                _mount_tmpfs(base / sub, size_mb)
            os.chmod(base / sub, 0o1777)  # like /tmp: commands add files, cannot drop the env's
        for name, text in _IDENTITY.items():
            (base / name).write_text(text)
            os.chmod(base / name, 0o644)
        if rootfs is not None and mounted:
            rootfs = _bind_rootfs(rootfs, base / "rootfs")
        if host_uid is not None:
            cgroup = create_cgroup(
                base.name, memory_mb=spec.memory_mb, cpus=spec.cpus, pids=spec.pids + 2
            )
    except BaseException:
        _remove_scratch(base, mounted, cgroup)
        raise
    return _Scratch(base, mounted, rootfs, cgroup)


def _mount_tmpfs(path: Path, size_mb: int) -> bool:
    """Mount a size-capped tmpfs on ``path``; False (and a warning) where mounting is denied."""
    options = f"size={size_mb}m,mode=0700,nosuid,nodev"
    argv = ["mount", "-t", "tmpfs", "-o", options, "libra-sandbox", str(path)]
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        _log.warning("no tmpfs for sandbox dirs (%s): work dir size is not capped", done.stderr)
    return done.returncode == 0


def _bind_rootfs(rootfs: Path, target: Path) -> Path:
    target.mkdir()
    argv = ["mount", "--bind", "-o", "ro", str(rootfs), str(target)]
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SandboxError(f"cannot bind the root filesystem {rootfs}: {done.stderr.strip()}")
    return target


def _remove_scratch(base: Path, mounted: bool, cgroup: SandboxCgroup | None = None) -> None:
    # No command runs by now (each died with its pid namespace): nothing races these calls.
    if cgroup is not None and not cgroup.remove():
        _log.warning("sandbox cgroup %s is still busy; it is reaped later", base.name)
    if mounted:  # lazily detaches the tmpfs mounts and the root filesystem bind inside them
        subprocess.run(["umount", "-l", str(base)], capture_output=True, check=False)
    if os.geteuid() != 0:
        _make_dirs_writable(base)
    shutil.rmtree(base, ignore_errors=True)


def _make_dirs_writable(base: Path) -> None:
    """A command may leave directories it cannot write; as the same non-root uid, fix that."""
    for parent, dirnames, _ in os.walk(base):
        for name in dirnames:
            path = os.path.join(parent, name)
            if not os.path.islink(path):  # chmod follows links: never touch a link's target
                with contextlib.suppress(OSError):
                    os.chmod(path, 0o700)


def reap_stale_workdirs() -> list[Path]:
    """Remove the trajectory directories of dead processes (e.g. a killed run); return them."""
    parent = _workdirs_parent()
    mounts = _mount_points()
    reaped: list[Path] = []
    for base in parent.iterdir():
        if _owner_alive(base.name):
            continue
        with contextlib.suppress(OSError):
            _remove_scratch(base, str(base) in mounts)
            reaped.append(base)
    for dirs in stale_cgroup_dirs(lambda name: not _owner_alive(name)).values():
        SandboxCgroup(dirs).remove()
    return reaped


def _owner_alive(name: str) -> bool:
    """Whether the process that named a trajectory directory (or cgroup) still runs."""
    pid_text, _, rest = name.partition("-")
    started = rest.rsplit("-", 1)[0]
    return pid_text.isdigit() and process_start_time(int(pid_text)) == started


def _mount_points() -> set[str]:
    with open("/proc/self/mounts") as mounts:
        return {fields[1] for fields in (line.split() for line in mounts) if len(fields) > 1}


# ---------------------------------------------------------------------------------------------
# Command line


def _mount_args(scratch: _Scratch, workdir: str, network: bool) -> list[str]:
    """bwrap's mounts: read-only system dirs, /proc, /dev, the work dir and /tmp."""
    args: list[str] = []
    source = scratch.rootfs or Path("/")
    for name in _SYSTEM_DIRS:
        args += _ro_bind(source / name, f"/{name}")
    if scratch.rootfs is not None:
        args += _ro_bind(scratch.rootfs / "etc", "/etc")
    else:
        args += ["--dir", "/etc"]
        for name in _HOST_ETC_FILES:
            args += _ro_bind(Path("/etc") / name, f"/etc/{name}")
    args += _identity_binds(scratch, network)
    # A minimal /dev, read-only but for a capped /dev/shm (bwrap's own is writable, uncapped).
    args += ["--proc", "/proc", "--dev", "/dev"]
    args += ["--perms", "1777", "--size", str(_TMP_SIZE_MB << 20), "--tmpfs", "/dev/shm"]
    args += ["--remount-ro", "/dev"]
    args += ["--bind", str(scratch.work), workdir, "--bind", str(scratch.tmp), "/tmp"]
    # bwrap's own root is a writable tmpfs: make it read-only once everything is mounted,
    # so only the work dir, /tmp and /dev/shm take writes (as in the Docker sandbox).
    return [*args, "--remount-ro", "/"]


def _identity_binds(scratch: _Scratch, network: bool) -> list[str]:
    """The sandbox's own hostname, hosts and resolver files over whatever /etc holds (an
    image's carry those of the machine that built it)."""
    args: list[str] = []
    for name in _IDENTITY:
        source = scratch.base / name
        if name == "resolv.conf" and network:
            source = Path("/etc/resolv.conf")
        target_exists = scratch.rootfs is None or (scratch.rootfs / "etc" / name).exists()
        if source.exists() and target_exists:  # bwrap cannot add a file to a read-only /etc
            args += ["--ro-bind", str(source), f"/etc/{name}"]
    return args


def _ro_bind(host: Path, inside: str) -> list[str]:
    if host.is_symlink():  # e.g. /bin -> usr/bin on merged-/usr systems
        return ["--symlink", os.readlink(host), inside]
    if host.exists():
        return ["--ro-bind", str(host), inside]
    return []


# As root: join the trajectory's cgroup (one cgroup.procs per hierarchy), then become its uid.
_JOIN_CGROUP = 'for f in "$@"; do [ "$f" = -- ] && break; echo $$ > "$f" || exit 125; shift; done'


def _enter_cgroup_as(host_uid: int | None, cgroup: SandboxCgroup | None) -> list[str]:
    """The wrapper that puts the command in ``cgroup`` and drops root for ``host_uid``."""
    if host_uid is None:  # not root: the command runs as the caller, in the caller's cgroup
        return []
    procs = cgroup.procs_files if cgroup is not None else []
    user = [f"--reuid={host_uid}", f"--regid={host_uid}", "--clear-groups"]
    join = f'{_JOIN_CGROUP}; shift; exec "$@"'
    return ["sh", "-c", join, "sh", *procs, "--", "setpriv", *user, "--"]


def _limits(spec: SandboxSpec, timeout_s: float, host_uid: int | None) -> list[str]:
    # RLIMIT_NPROC counts every task of the uid: the budget comes on top of those it has now,
    # such as earlier calls' namespace inits that the host's init has yet to reap (seconds,
    # in some containers). bwrap itself takes two tasks (its parent and its pid-1 reaper).
    tasks = _tasks_of_uid(os.getuid() if host_uid is None else host_uid) + spec.pids + 2
    return [
        "prlimit",
        f"--as={spec.memory_mb * 1024 * 1024}",
        f"--nproc={tasks}",
        f"--cpu={math.ceil(timeout_s) + 1}",
        f"--fsize={spec.workdir_size_mb * 1024 * 1024}",
        "--core=0",
        "--",
    ]


def _tasks_of_uid(uid: int) -> int:
    """How many tasks (threads) ``uid`` runs now: what RLIMIT_NPROC counts."""
    count = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if entry.stat().st_uid == uid:
                    count += len(os.listdir(f"/proc/{entry.name}/task"))
    return count


# ---------------------------------------------------------------------------------------------
# Sandbox


class BwrapSandbox:
    """A trajectory's bubblewrap sandbox: its files persist across calls, processes do not."""

    def __init__(self, spec: SandboxSpec, scratch: _Scratch, host_uid: int | None) -> None:
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
            *_enter_cgroup_as(self.host_uid, self._scratch.cgroup),
            *_limits(spec, timeout_s, self.host_uid),
            "bwrap",
            "--unshare-all",
            *network,
            *kernel,
            "--die-with-parent",
            "--new-session",
            *identity,
            *_mount_args(self._scratch, spec.workdir, spec.network),
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
        self._open: dict[Path, _Scratch] = {}

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
            scratch = await anyio.to_thread.run_sync(_make_scratch, spec, host_uid, rootfs)
            self._open[scratch.base] = scratch
            try:
                yield BwrapSandbox(spec, scratch, host_uid)
            finally:
                with anyio.CancelScope(shield=True):
                    if self._open.pop(scratch.base, None) is not None:
                        await anyio.to_thread.run_sync(
                            _remove_scratch, scratch.base, scratch.mounted, scratch.cgroup
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
                    _remove_scratch, scratch.base, scratch.mounted, scratch.cgroup
                )
