"""An agent: the user's function for one episode, found by ``package.module:function``."""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from libra.envs import Task, UnknownEnvError, load_object

#: ``async def agent(task, client) -> float | None`` (``client``: ``openai.AsyncOpenAI``).
AgentFunction = Callable[[Task, Any], Awaitable[float | None]]


@dataclass(frozen=True)
class Agent:
    """An agent function and the name its records carry (their ``env``)."""

    name: str
    play: AgentFunction


def load_agent(spec: str) -> Agent:
    """The ``async def`` at ``package.module:function`` (looked for in the current
    directory first), named by its function."""
    target = load_object(spec, "agent")
    if not inspect.iscoroutinefunction(target):
        raise UnknownEnvError(
            f"agent {spec!r} must be an async def taking (task, client), not {target!r}"
        )
    return Agent(spec.rpartition(":")[2], target)
