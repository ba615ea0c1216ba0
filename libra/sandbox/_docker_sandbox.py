"""A Docker sandbox: one pooled container lent to one trajectory, its commands and files.

Processes do not outlive the call that started them: when no exec of the sandbox is running
any more, every process of the sandbox user is killed (a daemon started by one tool call is
gone before the next), as in bubblewrap.

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
"""

from __future__ import annotations

import functools
import posixpath
import time
from collections.abc import Mapping, Sequence
from typing import Any

import anyio

from libra.envs import ExecResult, SandboxError, SandboxSpec, check_exec_args
from libra.sandbox._docker_container import ROOT_USER, DockerContainers
from libra.sandbox._docker_exec import RawExec, exec_blocking

_KILL_GRACE_S = 0.5  # after the in-container timeout fires, time for its output to drain
_READ_FILE_LIMIT = 256 * 1024 * 1024
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


class DockerSandbox:
    """One pooled container lent to one trajectory (see the module docstring for the rules)."""

    def __init__(self, provider: DockerContainers, container_id: str, spec: SandboxSpec):
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
