"""What the gateway's HTTP surface asks of its core, and nothing more.

``libra serve`` is two halves. The HTTP surface (``_app``) speaks the OpenAI API to
clients: it parses and validates requests, authenticates them, streams, counts. The core
(``_sessions``) knows sessions: it finds the trajectory a chat request continues, turns
the tool results it carries into tool-return signals for the scheduler, generates the
next assistant turn through the scheduler's router (the engine's own generation path:
exact token ids where the server speaks them), and records the session as a trajectory.
The surface sees the core only through :class:`GatewayCore`.
"""

from __future__ import annotations

from typing import Literal, Protocol

import msgspec

from libra import openai
from libra.signals import ToolStatus

FinishReason = Literal["stop", "length", "tool_calls"]


class ChatTurn(msgspec.Struct, frozen=True):
    """A validated chat request, as the core needs it: the surface has already checked
    every field and refused what it does not support (with a 400)."""

    messages: list[openai.Message]
    tools: list[dict[str, object]] = msgspec.field(default_factory=list)
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: list[str] = msgspec.field(default_factory=list)
    session: str | None = None  # the client's session key (header or ``user``), if any


class ChatReply(msgspec.Struct, frozen=True):
    """One assistant turn, returned whole or streamed by the surface."""

    session: str  # the session it belongs to (echoed to the client in a header)
    content: str | None
    tool_calls: list[openai.ToolCall]
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    endpoint: str  # the upstream instance that generated it
    weight_version: int


class FleetStatus(msgspec.Struct, frozen=True):
    """What the admin API reports: each upstream endpoint's weight version and health."""

    versions: dict[str, int]
    healthy: dict[str, bool]
    paused: bool


class GatewayCore(Protocol):
    """Sessions and the fleet behind one OpenAI-compatible endpoint."""

    def models(self) -> list[str]:
        """The model names clients may ask for (``/v1/models``)."""
        ...

    async def chat(self, turn: ChatTurn) -> ChatReply:
        """The next assistant turn of ``turn``'s session (a new session if none matches).
        Raises ``libra.engine.RequestRejected`` for a request the upstream refused and
        ``libra.engine.ServerUnavailable`` when no upstream could answer."""
        ...

    async def complete(
        self, request: openai.CompletionRequest, session: str | None = None
    ) -> openai.Completion:
        """A ``/v1/completions`` call, routed to one upstream: the next turn of the
        client's ``session`` for the scheduler (a token-level client's multi-turn
        trajectory), else a one-off it forgets at once."""
        ...

    async def tokenize(
        self,
        messages: list[openai.Message],
        tools: list[dict[str, object]] | None,
        add_generation_prompt: bool,
    ) -> list[int]:
        """``messages`` (and ``tools``) as the model's chat template renders them, in
        token ids (vLLM's ``/tokenize``, answered by an upstream)."""
        ...

    async def report(
        self,
        session: str,
        *,
        tool: tuple[str, ToolStatus] | None = None,
        reward: float | None = None,
        done: bool = False,
    ) -> None:
        """A client's own account of its session: a tool's outcome (name, status), the
        final reward, or its end (``done``: recorded now rather than at the idle TTL).
        Raises ``KeyError`` for a session that is not live (unknown, or ended)."""
        ...

    async def pause(self) -> None: ...

    async def resume(self) -> None: ...

    async def reload_weights(self, path: str, version: int) -> float:
        """Load the weights folder ``path`` into every upstream as ``version``; seconds."""
        ...

    def status(self) -> FleetStatus: ...
