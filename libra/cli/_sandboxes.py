"""Sandboxes for envs whose tools run code: Docker where an engine runs, else bubblewrap."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Literal

from libra.envs import Env, SandboxError, SandboxProvider
from libra.sandbox import BwrapSandboxProvider, DockerSandboxProvider, connect_docker

SandboxKind = Literal["auto", "docker", "bwrap"]


@asynccontextmanager
async def open_sandboxes(
    env_cls: type[Env], kind: SandboxKind, pool_size: int
) -> AsyncIterator[SandboxProvider | None]:
    """The provider the env needs (None when its tools run no code)."""
    if env_cls.sandbox_spec is None:
        yield None
        return
    if kind == "auto":
        kind = "docker" if _docker_reachable() else "bwrap"
    provider: DockerSandboxProvider | BwrapSandboxProvider
    if kind == "docker":
        provider = DockerSandboxProvider(pool_size=pool_size)
    else:
        provider = BwrapSandboxProvider()
    async with provider:
        yield provider


def _docker_reachable() -> bool:
    try:
        connect_docker(timeout_s=5).close()
    except SandboxError:
        return False
    return True
