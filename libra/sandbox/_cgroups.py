"""One control group per bubblewrap sandbox: memory, CPU and process limits for all its
processes together (rlimits hold per process only: six processes could each take the
whole memory budget).

Needs root and a writable cgroup file system: cgroup v2 (the unified hierarchy, with the
``memory``, ``pids`` and ``cpu`` controllers) or cgroup v1 (one hierarchy per controller, as
on hosts that run Docker with the cgroupfs driver). A sandbox's group is
``libra-bwrap/<name>`` beneath the cgroup of the calling process (v1) or beneath the root
(v2, where a group holding processes cannot delegate controllers). Where none can be made,
:func:`create_cgroup` returns None and the provider says what is then not enforced.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = ["SandboxCgroup", "create_cgroup", "remove_cgroup_dirs", "stale_cgroup_dirs"]

_log = logging.getLogger(__name__)

PARENT_NAME = "libra-bwrap"
_CONTROLLERS = ("memory", "pids", "cpu")
_CPU_PERIOD_US = 100_000
_REMOVE_TRIES = 50  # x 20 ms: how long exiting processes may take to leave the group


@dataclass(frozen=True, slots=True)
class SandboxCgroup:
    """The group's directory in each hierarchy that carries one of its controllers."""

    dirs: tuple[Path, ...]

    def budget_pids(self, count: int) -> None:
        """Allow ``count`` more tasks than the group holds now: an exec's budget on top of the
        exiting tasks of earlier ones, which count until the host's init reaps them."""
        for directory in self.dirs:
            current = directory / "pids.current"
            if current.exists():
                (directory / "pids.max").write_text(str(int(current.read_text()) + count))

    @property
    def procs_files(self) -> list[str]:
        """Where a process writes its pid to join the group (one file per hierarchy)."""
        return [str(directory / "cgroup.procs") for directory in self.dirs]

    def pids(self) -> set[int]:
        members: set[int] = set()
        for directory in self.dirs:
            with contextlib.suppress(OSError):
                members |= {int(pid) for pid in (directory / "cgroup.procs").read_text().split()}
        return members

    def kill_all(self) -> None:
        """SIGKILL every process in the group."""
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)

    def remove(self) -> bool:
        """Kill what is left and remove the group; False when it would not go away."""
        return remove_cgroup_dirs(self.dirs, kill=self.kill_all)


def remove_cgroup_dirs(dirs: tuple[Path, ...], *, kill: Callable[[], None] | None = None) -> bool:
    """Remove each group (after ``kill``, retried while exiting processes leave it)."""
    removed = True
    for directory in dirs:
        for _ in range(_REMOVE_TRIES):
            if kill is not None:
                kill()
            try:
                directory.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:  # busy: killed processes are still exiting
                time.sleep(0.02)
        else:
            removed = False
    return removed


# ---------------------------------------------------------------------------------------------
# Hierarchies


@dataclass(frozen=True, slots=True)
class _Hierarchy:
    """Where new sandbox groups go in one mounted hierarchy, and its version."""

    parent: Path
    controllers: tuple[str, ...]
    version: int


def _mounts() -> Iterator[tuple[str, str, set[str]]]:
    """(mount point, file system type, options) of every cgroup mount."""
    with contextlib.suppress(OSError), open("/proc/self/mounts") as mounts:
        for line in mounts:
            fields = line.split()
            if len(fields) >= 4 and fields[2] in ("cgroup", "cgroup2"):
                yield fields[1], fields[2], set(fields[3].split(","))


def _own_paths() -> dict[str, str]:
    """This process's group per v1 controller ("memory" -> "/a/b"); key "" for v2."""
    paths: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            for controller in controllers.split(",") if controllers else [""]:
                paths[controller] = path
    return paths


def _hierarchies() -> list[_Hierarchy]:
    """v2 when it offers every controller, else the v1 hierarchies that carry them."""
    mounts = list(_mounts())
    for point, kind, _ in mounts:
        if kind == "cgroup2":
            available = set(Path(point, "cgroup.controllers").read_text().split())
            if set(_CONTROLLERS) <= available:
                return [_Hierarchy(Path(point) / PARENT_NAME, _CONTROLLERS, 2)]
    own = _own_paths()
    found: list[_Hierarchy] = []
    for point, kind, options in mounts:
        carried = tuple(c for c in _CONTROLLERS if c in options)
        if kind == "cgroup" and carried:
            path = own.get(carried[0], "/").lstrip("/")
            found.append(_Hierarchy(Path(point) / path / PARENT_NAME, carried, 1))
    return found if {c for h in found for c in h.controllers} >= set(_CONTROLLERS) else []


# ---------------------------------------------------------------------------------------------
# Creation


def create_cgroup(name: str, *, memory_mb: int, cpus: float, pids: int) -> SandboxCgroup | None:
    """A group ``name`` with these limits, or None (logged) where groups cannot be made."""
    if os.geteuid() != 0:
        return None
    made: list[Path] = []
    try:
        hierarchies = _hierarchies()
        for hierarchy in hierarchies:
            made.append(_make_group(hierarchy, name))
            _set_limits(hierarchy, made[-1], memory_mb=memory_mb, cpus=cpus, pids=pids)
    except OSError as error:
        _log.warning("no cgroup for bwrap sandboxes (%s): limits hold per process only", error)
        remove_cgroup_dirs(tuple(made))
        return None
    return SandboxCgroup(tuple(made)) if hierarchies else None


def _make_group(hierarchy: _Hierarchy, name: str) -> Path:
    if not hierarchy.parent.is_dir():
        hierarchy.parent.mkdir(exist_ok=True)
        if hierarchy.version == 2:  # let the sandboxes' groups use the controllers
            enable = " ".join(f"+{c}" for c in _CONTROLLERS)
            (hierarchy.parent.parent / "cgroup.subtree_control").write_text(enable)
            (hierarchy.parent / "cgroup.subtree_control").write_text(enable)
    group = hierarchy.parent / name
    group.mkdir()
    return group


def _set_limits(
    hierarchy: _Hierarchy, group: Path, *, memory_mb: int, cpus: float, pids: int
) -> None:
    memory = str(memory_mb * 1024 * 1024)
    quota = str(max(1000, round(cpus * _CPU_PERIOD_US)))
    if hierarchy.version == 2:
        settings = [
            ("memory.max", memory),
            ("memory.swap.max", "0"),
            ("pids.max", str(pids)),
            ("cpu.max", f"{quota} {_CPU_PERIOD_US}"),
        ]
    else:
        settings = []
        if "memory" in hierarchy.controllers:
            # memsw (memory plus swap) exists only with swap accounting; it must follow memory.
            settings += [("memory.limit_in_bytes", memory), ("memory.memsw.limit_in_bytes", memory)]
        if "pids" in hierarchy.controllers:
            settings.append(("pids.max", str(pids)))
        if "cpu" in hierarchy.controllers:
            settings += [("cpu.cfs_period_us", str(_CPU_PERIOD_US)), ("cpu.cfs_quota_us", quota)]
    for file_name, value in settings:
        target = group / file_name
        if target.exists() or not file_name.startswith("memory.memsw"):
            target.write_text(value)


# ---------------------------------------------------------------------------------------------
# Reaping


def stale_cgroup_dirs(is_stale: Callable[[str], bool]) -> dict[str, tuple[Path, ...]]:
    """The sandbox groups, by name, for which ``is_stale(name)`` holds."""
    if os.geteuid() != 0:
        return {}
    groups: dict[str, list[Path]] = {}
    with contextlib.suppress(OSError):
        for hierarchy in _hierarchies():
            if hierarchy.parent.is_dir():
                for group in hierarchy.parent.iterdir():
                    if group.is_dir() and is_stale(group.name):
                        groups.setdefault(group.name, []).append(group)
    return {name: tuple(dirs) for name, dirs in groups.items()}
