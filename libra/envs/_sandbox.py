"""The sandbox protocol: where an env's tools run code that must not touch the host.

An env declares what it needs with a :class:`SandboxSpec`; the engine gets a
:class:`Sandbox` for each trajectory from a :class:`SandboxProvider` (a warm pool of
Docker containers, or bubblewrap on machines without Docker) and hands it to the env
as ``env.sandbox``. Tools then call :meth:`Sandbox.exec`. Network stays closed unless
the spec asks for it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Protocol

from libra.signals import ToolStatus


@dataclass(frozen=True, slots=True)
class SandboxSpec:
    """What a trajectory's sandbox must provide. Safe by default."""

    image: str = "libra/python"
    network: bool = False
    memory_mb: int = 512
    cpus: float = 1.0
    pids: int = 128
    workdir: str = "/work"
    workdir_size_mb: int = 64
    output_limit_bytes: int = 64 * 1024
    env: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ExecResult:
    exit_code: int
    stdout: str
    stderr: str
    timed_out: bool = False
    truncated: bool = False
    duration_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    @property
    def status(self) -> ToolStatus:
        """How the command went, as the scheduler's signal reads it."""
        if self.timed_out:
            return "timeout"
        return "success" if self.exit_code == 0 else "failure"


class SandboxError(RuntimeError):
    """The sandbox could not be created or used (not a failure of the command run in it)."""


def check_exec_args(argv: Sequence[str], timeout_s: float) -> None:
    """Refuse an :meth:`Sandbox.exec` call that names no command or gives it no time.

    A ``ValueError``, not a :class:`SandboxError`: the caller is wrong, not the sandbox.
    """
    if not argv:
        raise ValueError("argv must name a command")
    if timeout_s <= 0:
        raise ValueError("timeout_s must be positive")


class Sandbox(Protocol):
    async def exec(
        self,
        argv: Sequence[str],
        *,
        timeout_s: float,
        stdin: bytes | None = None,
        workdir: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> ExecResult:
        """Run ``argv``; on timeout kill its whole process tree and return ``timed_out``."""
        ...

    async def write_file(self, path: str, data: bytes, *, mode: int = 0o644) -> None:
        """Write a file inside the sandbox (relative paths are under the work dir)."""
        ...

    async def read_file(self, path: str) -> bytes: ...


class SandboxProvider(Protocol):
    def sandbox(self, spec: SandboxSpec) -> AbstractAsyncContextManager[Sandbox]:
        """A sandbox for one trajectory, reset or destroyed when the context exits."""
        ...

    async def aclose(self) -> None: ...
