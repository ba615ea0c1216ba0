"""What the engine asks of a scheduler, and nothing more.

The engine calls :meth:`Scheduler.route` before every generation call and
:meth:`Scheduler.release` after it (with the call's :data:`CallOutcome`), feeds every
tool return to :meth:`Scheduler.on_tool_return`, and reports the end of each
trajectory with :meth:`Scheduler.on_finish`. Policies (round robin, least-loaded, C-MLFQ, ...) live
beside this module and see only these calls: never an env, never the engine. Every
scheduler routes over a :class:`~libra.sched.Router`, the live fleet that membership
changes and weight syncs go through.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol

from libra.fleet import Endpoint
from libra.sched._instance import Instance
from libra.signals import ToolSignal

if TYPE_CHECKING:  # the router implements this protocol's hooks
    from libra.sched._buckets import Router

CallOutcome = Literal["ok", "failed", "rejected", "cancelled", "migrated"]
"""How a generation call ended, as the engine reports it to :meth:`Scheduler.release`.

- ``ok``: the server answered.
- ``failed``: the server failed (unreachable, connection reset, 5xx or 429, a timeout, a
  malformed answer). The only outcome that marks an instance down (for a cooldown).
- ``rejected``: the server refused this request (4xx): the request's fault, not the
  server's.
- ``cancelled``: the caller gave the call up (the rollout was cancelled, the trajectory
  ended) or never sent it.
- ``migrated``: the call ended early on purpose (vLLM aborted it for a pause or a drain,
  or its instance left the fleet) and the turn goes on elsewhere.
"""


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
    can account the call's tokens to it. ``weight_version`` is the endpoint's weights when
    the call was routed; ``instance`` is the router's incarnation of the endpoint that
    counts the call (a name re-added later is another incarnation, never decremented by
    this call's release). ``max_tokens``, when set, is the policy's quantum: the call
    samples at most that many tokens, and a turn that is not done by then is routed again
    for the rest (on the token path, and only for turns without stop strings, which could
    straddle two calls: a chat reply or such a turn is not cut).
    """

    endpoint: Endpoint
    priority: int | None = None
    bucket: str = ""
    trajectory_id: str = ""
    weight_version: int = 0
    instance: Instance | None = field(default=None, repr=False, compare=False)
    max_tokens: int | None = None

    @property
    def retired(self) -> bool:
        """The call's instance has left the fleet since (draining or removed): a failure
        there was planned, not the server's."""
        return self.instance is not None and self.instance.state != "active"

    @property
    def weights_changed(self) -> bool:
        """New weights were loaded into the endpoint while the call ran."""
        return self.endpoint.weight_version != self.weight_version


class NoEndpointAvailable(RuntimeError):
    """Every endpoint the scheduler knows is down, draining or excluded (or there is none)."""


class Scheduler(Protocol):
    @property
    def router(self) -> Router:
        """The live fleet: every endpoint, its load and membership (shared with whoever
        adds, drains or removes instances and syncs weights)."""
        ...

    def route(self, request: RouteRequest, exclude: frozenset[str] = frozenset()) -> Route:
        """Pick the endpoint for the next call; skip endpoints whose name is in ``exclude``.

        Raises :class:`NoEndpointAvailable` when there is none.
        """
        ...

    def release(self, route: Route, *, outcome: CallOutcome, new_tokens: int) -> None:
        """The call made on ``route`` is over; ``outcome`` says how (see
        :data:`CallOutcome`), ``new_tokens`` what it sampled."""
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
