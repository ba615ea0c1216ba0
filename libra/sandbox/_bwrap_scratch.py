"""A bubblewrap trajectory's host directory: its work dir, ``/tmp`` and identity files (size-capped
tmpfs mounts as root), the bind of the image's root filesystem, its cgroup, and reaping the
directories of dead runs."""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from libra.envs import SandboxError, SandboxSpec
from libra.sandbox._cgroups import SandboxCgroup, create_cgroup, stale_cgroup_dirs
from libra.sandbox._common import process_start_time

_log = logging.getLogger(__name__)

TMP_SIZE_MB = 16  # /tmp, and /dev/shm
_BASE_SIZE_MB = 1  # the trajectory directory itself: mount points and the identity files

# The sandbox's own /etc/hostname and /etc/hosts; /etc/resolv.conf is empty without network
# and the host's with it (the command then shares the host's network).
IDENTITY = {
    "hostname": "sandbox\n",
    "hosts": "127.0.0.1\tlocalhost\n127.0.1.1\tsandbox\n::1\tlocalhost\n",
    "resolv.conf": "",
}


def workdirs_parent() -> Path:
    """Where trajectory directories live: traversable (bwrap resolves bind paths as the
    sandbox uid) but not listable."""
    parent = Path(tempfile.gettempdir()) / f"libra-bwrap-{os.geteuid()}"
    parent.mkdir(mode=0o711, exist_ok=True)
    os.chmod(parent, 0o711)
    return parent


@dataclass(frozen=True, slots=True)
class Scratch:
    """A trajectory's host directory: ``work`` and ``tmp`` are bound into every command, and
    ``rootfs`` (when set) is a bind of the image's root filesystem that the sandbox uid can
    reach (the image itself may lie under a root-only home). ``cgroup`` holds all the
    trajectory's processes (None where cgroups cannot be made: see "bubblewrap without
    root" in docs/guides/sandboxes.md)."""

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


def make_scratch(spec: SandboxSpec, host_uid: int | None, rootfs: Path | None) -> Scratch:
    pid = os.getpid()
    base = workdirs_parent() / f"{pid}-{process_start_time(pid)}-{secrets.token_hex(4)}"
    base.mkdir(mode=0o700)
    mounted = False
    cgroup = None
    try:
        if host_uid is not None:
            mounted = _mount_tmpfs(base, _BASE_SIZE_MB)
            # Only root and the trajectory's own uid (through its group) may pass through.
            os.chown(base, 0, host_uid)
            os.chmod(base, 0o710)
        for sub, size_mb in (("work", spec.workdir_size_mb), ("tmp", TMP_SIZE_MB)):
            (base / sub).mkdir()
            if mounted:  # each its own cap, as Docker's two tmpfs mounts
                _mount_tmpfs(base / sub, size_mb)
            os.chmod(base / sub, 0o1777)  # like /tmp: commands add files, cannot drop the env's
        for name, text in IDENTITY.items():
            (base / name).write_text(text)
            os.chmod(base / name, 0o644)
        if rootfs is not None and mounted:
            rootfs = _bind_rootfs(rootfs, base / "rootfs")
        if host_uid is not None:
            cgroup = create_cgroup(
                base.name, memory_mb=spec.memory_mb, cpus=spec.cpus, pids=spec.pids + 2
            )
    except BaseException:
        remove_scratch(base, mounted, cgroup)
        raise
    return Scratch(base, mounted, rootfs, cgroup)


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


def remove_scratch(base: Path, mounted: bool, cgroup: SandboxCgroup | None = None) -> None:
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
    parent = workdirs_parent()
    mounts = _mount_points()
    reaped: list[Path] = []
    for base in parent.iterdir():
        if _owner_alive(base.name):
            continue
        with contextlib.suppress(OSError):
            remove_scratch(base, str(base) in mounts)
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
