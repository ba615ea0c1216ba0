"""Sandboxes for envs whose tools run code: Docker where an engine runs, else bubblewrap."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from contextlib import asynccontextmanager, suppress
from typing import Any, Literal, TypeVar

import anyio

from libra.envs import Env, SandboxError, SandboxProvider
from libra.sandbox import BwrapSandboxProvider, DockerSandboxProvider, connect_docker

SandboxKind = Literal["auto", "docker", "bwrap"]
T = TypeVar("T")


@asynccontextmanager
async def open_sandboxes(
    envs: Sequence[type[Env]], kind: SandboxKind, pool_size: int
) -> AsyncIterator[SandboxProvider | None]:
    """The provider the envs need (None when none of their tools runs code, or there is
    no env: an agent runs its own tools)."""
    if not any(env_cls.sandbox_spec for env_cls in envs):
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


async def warm_up(provider: SandboxProvider | None, envs: Sequence[type[Env]], count: int) -> None:
    """Start ``count`` containers ahead of the trajectories, shared among the envs whose
    tools run code (Docker only: a bubblewrap jail starts in milliseconds). An
    optimisation: a sandbox that cannot start fails the trajectory that asks for it, with
    the reason, not this."""
    specs = [env_cls.sandbox_spec for env_cls in envs if env_cls.sandbox_spec]
    if not isinstance(provider, DockerSandboxProvider) or not specs:
        return
    for index, spec in enumerate(specs):
        share = count // len(specs) + (index < count % len(specs))
        with suppress(SandboxError):
            await provider.prewarm(spec, share)


async def beside(
    main: Callable[[], Awaitable[T]], side: Callable[[], Coroutine[Any, Any, None]]
) -> T:
    """``main()`` while ``side()`` runs too; returns when both are done. ``main``'s error
    comes out as itself (``side`` must not raise), not inside an exception group."""
    outcome: list[T] = []
    failure: list[Exception] = []
    async with anyio.create_task_group() as group:
        group.start_soon(side)
        try:
            outcome.append(await main())
        except Exception as error:
            failure.append(error)
            group.cancel_scope.cancel()  # no use warming up for a run that cannot start
    if failure:
        raise failure[0]
    return outcome[0]
