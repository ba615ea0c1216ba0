"""The settings of one emulated server: model name, timing, script, context length and the
rates of the faults it injects."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from libra.emulation._latency import LatencyModel
from libra.emulation._scripts import AgentScript


class EmulatorConfig(BaseModel):
    """Settings of one emulated server."""

    model_config = ConfigDict(frozen=True, extra="forbid", protected_namespaces=())

    model_name: str = Field(
        default="libra-emulated", description="Served model name (requests must use it)."
    )
    latency: LatencyModel = Field(
        default_factory=LatencyModel,
        description="Timing model; LatencyModel.zero() answers at once.",
    )
    script: Literal["agent", "echo"] = Field(
        default="agent", description="Built-in model behaviour, unless create_app gets one."
    )
    agent: AgentScript = Field(
        default_factory=AgentScript, description="Settings of the 'agent' script."
    )
    seed: int = Field(default=0, description="Seeds replies, logprobs and failure injection.")
    max_model_len: int = Field(
        default=32768, ge=1, description="Context length: prompt plus new tokens, in tokens."
    )
    error_rate: float = Field(
        default=0.0,
        ge=0,
        le=1,
        description="Fraction of generation requests answered with HTTP 500 (injected).",
    )
    stall_rate: float = Field(
        default=0.0,
        ge=0,
        le=1,
        description="Fraction of generation requests never answered (until the client gives up).",
    )
    abort_rate: float = Field(
        default=0.0,
        ge=0,
        le=1,
        description="Fraction of generation requests ended early with a partial output and "
        "finish_reason 'abort', as vLLM ends them when paused in abort mode.",
    )
    garbage_rate: float = Field(
        default=0.0,
        ge=0,
        le=1,
        description="Fraction of generation requests answered 200 with a body that is not "
        "an OpenAI response (truncated or foreign JSON).",
    )
    die_rate: float = Field(
        default=0.0,
        ge=0,
        le=1,
        description="Probability per generation request that the server dies on it.",
    )
    die_after: int | None = Field(
        default=None,
        ge=0,
        description="The server dies on the generation request after this many (None: never). "
        "Run as a process it exits; in-process every later request fails to connect.",
    )
    prefix_caching: bool = Field(
        default=False,
        description="Reuse the KV of prompt prefixes seen before (vLLM's automatic prefix "
        "caching): only the uncached part of a prompt is prefilled.",
    )
    prefix_block_tokens: int = Field(
        default=256,
        ge=1,
        description="Granularity of the prefix cache in tokens (vLLM's blocks are 16; "
        "coarser blocks keep the emulator cheap and round hits down by less than one block).",
    )
    check_model_name: bool = Field(
        default=True, description="Answer 404 to requests for another model, like vLLM."
    )
    template_renders_tools: bool = Field(
        default=True,
        description="False: the chat template drops the request's tools, as SmolLM2's does "
        "(clients must describe them in the conversation).",
    )

    @model_validator(mode="after")
    def _check_fault_rates(self) -> EmulatorConfig:
        # One draw per request picks at most one fault, so the rates must fit in [0, 1].
        total = (
            self.error_rate + self.stall_rate + self.abort_rate + self.garbage_rate + self.die_rate
        )
        if total > 1:
            raise ValueError(f"the fault rates add up to {total:g}, more than 1")
        return self
