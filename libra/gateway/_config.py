"""The gateway core's settings (``[gateway]`` in a ``libra serve`` config)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, PositiveFloat, PositiveInt

from libra.config import Section
from libra.engine import SamplingConfig
from libra.serving import WeightSyncConfig


class GatewayConfig(Section):
    """Sessions, their recording, and what requests leave out."""

    session_ttl_s: PositiveFloat = Field(
        600.0, description="a session idle this long ends (recorded) and is forgotten"
    )
    sweep_every_s: PositiveFloat = Field(
        1.0, description="how often idle sessions are looked for (a background task)"
    )
    max_sessions: PositiveInt = Field(
        100_000,
        description="sessions held at once; a new one past it ends the longest idle one",
    )
    env: str = Field(
        "gateway",
        description="the env name the scheduler sees for sessions (what per-env signal "
        "rules match) and records carry",
    )
    any_model: bool = Field(
        False,
        description="answer a request whatever model it names, with the fleet's: a "
        "training run's agents, written for some other model name, train the run's policy",
    )
    record_path: Path | None = Field(
        None, description="append every ended session here as one JSONL record; None: off"
    )
    record_stream: bool = Field(
        False, description="offer ended sessions to Sessions.records() (a trainer's stream)"
    )
    record_buffer: PositiveInt = Field(
        1024,
        description="records the stream holds for a slow reader; past it the oldest is "
        "dropped (and counted): clients never wait for the reader",
    )
    pause_mode: Literal["abort", "keep", "wait"] = Field(
        "keep", description="how pause() pauses the upstream servers (vLLM's /pause modes)"
    )
    sampling: SamplingConfig = Field(
        default_factory=SamplingConfig,
        description="what a request leaves out (max_tokens: max_tokens_per_turn)",
    )
    weight_sync: WeightSyncConfig = Field(default_factory=WeightSyncConfig)
