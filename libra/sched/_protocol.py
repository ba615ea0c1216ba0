"""What the engine asks of a scheduler, and nothing more.

The engine calls :meth:`Scheduler.route` before every generation call and
:meth:`Scheduler.release` after it, feeds every tool return to
:meth:`Scheduler.on_tool_return`, and reports the end of each trajectory with
:meth:`Scheduler.on_finish`. Policies (round robin, least-loaded, C-MLFQ, ...) live
beside this module and see only these calls: never an env, never the engine.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass
from typing import Protocol

from libra.fleet import Endpoint
from libra.signals import ToolSignal


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What a scheduler knows about the next generation call of a trajectory.

    ``trajectory_id`` keys the trajectory while it lives (unique among live ones, so two
    RL steps in flight never share state); ``prompt_id`` keys its task, the same at every
    step (what prefix histories are learnt under, and saved across runs); ``env`` names
    its env (what per-env signal rules match). The ids are opaque: compare and store
    them, never parse them.

    ``context_tokens`` is the conversation so far (the call's prompt); ``generated_tokens``
    is how many of them the model itself sampled in earlier turns (its attained service);
    ``previous`` is the endpoint of the trajectory's last turn, where its prefix is cached.
    """

    trajectory_id: str
    prompt_id: str
    turn: int
    context_tokens: int
    previous: Endpoint | None = None
    generated_tokens: int = 0
    _: KW_ONLY
    env: str


@dataclass(frozen=True, slots=True)
class Route:
    """Where the next generation call goes; ``priority`` is vLLM's (lower runs first).

    ``trajectory_id`` names the trajectory the call serves, so that :meth:`Scheduler.release`
    can account the call's tokens to it.
    """

    endpoint: Endpoint
    priority: int | None = None
    bucket: str = ""
    trajectory_id: str = ""


class NoEndpointAvailable(RuntimeError):
    """Every endpoint the scheduler knows is down or excluded."""


class Scheduler(Protocol):
    def route(self, request: RouteRequest, exclude: frozenset[str] = frozenset()) -> Route:
        """Pick the endpoint for the next call; skip endpoints whose name is in ``exclude``.

        Raises :class:`NoEndpointAvailable` when there is none.
        """
        ...

    def release(self, route: Route, *, ok: bool, new_tokens: int) -> None:
        """The call made on ``route`` is over (``ok`` is False when it failed)."""
        ...

    def on_tool_return(self, trajectory_id: str, signal: ToolSignal) -> None:
        """A tool returned inside the trajectory: the causal signal C-MLFQ feeds on."""
        ...

    def on_finish(
        self, trajectory_id: str, prompt_id: str, *, output_tokens: int, failed: bool = False
    ) -> None:
        """The trajectory ended; ``output_tokens`` is what the model generated in all.

        ``failed``: it ended early (cancelled, server gone), so its length says nothing
        about the prompt's; forget it without learning from it."""
        ...

    def calls_in_flight(self) -> dict[str, int]:
        """Calls routed and not yet released, by endpoint name (what a progress plot shows)."""
        ...
