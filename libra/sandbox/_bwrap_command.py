"""The ``bwrap`` command line of a sandboxed command: its mounts (system dirs, ``/etc``, the
sandbox's identity, ``/proc``, ``/dev``, the work dir and ``/tmp``), the cgroup it joins and
the uid it becomes, and its rlimits."""

from __future__ import annotations

import contextlib
import math
import os
from pathlib import Path

from libra.envs import SandboxSpec
from libra.sandbox._bwrap_scratch import IDENTITY, TMP_SIZE_MB, Scratch
from libra.sandbox._cgroups import SandboxCgroup

# Top-level entries of a root filesystem that commands need; anything else stays invisible.
_SYSTEM_DIRS = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32")
# From the host's /etc only what programs need to start (no secrets; the host's name, hosts
# and resolver are replaced by the sandbox's own: see IDENTITY).
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


def mount_args(scratch: Scratch, workdir: str, network: bool) -> list[str]:
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
    args += ["--perms", "1777", "--size", str(TMP_SIZE_MB << 20), "--tmpfs", "/dev/shm"]
    args += ["--remount-ro", "/dev"]
    args += ["--bind", str(scratch.work), workdir, "--bind", str(scratch.tmp), "/tmp"]
    # bwrap's own root is a writable tmpfs: make it read-only once everything is mounted,
    # so only the work dir, /tmp and /dev/shm take writes (as in the Docker sandbox).
    return [*args, "--remount-ro", "/"]


def _identity_binds(scratch: Scratch, network: bool) -> list[str]:
    """The sandbox's own hostname, hosts and resolver files over whatever /etc holds (an
    image's carry those of the machine that built it)."""
    args: list[str] = []
    for name in IDENTITY:
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


def enter_cgroup_as(host_uid: int | None, cgroup: SandboxCgroup | None) -> list[str]:
    """The wrapper that puts the command in ``cgroup`` and drops root for ``host_uid``."""
    if host_uid is None:  # not root: the command runs as the caller, in the caller's cgroup
        return []
    procs = cgroup.procs_files if cgroup is not None else []
    user = [f"--reuid={host_uid}", f"--regid={host_uid}", "--clear-groups"]
    join = f'{_JOIN_CGROUP}; shift; exec "$@"'
    return ["sh", "-c", join, "sh", *procs, "--", "setpriv", *user, "--"]


def limits(spec: SandboxSpec, timeout_s: float, host_uid: int | None) -> list[str]:
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
