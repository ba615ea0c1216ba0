"""The workload file format (TOML), validated with pydantic.

A workload describes agentic trajectories as *attempts*: in each attempt the model
calls some exploration tools (read a file, search), then one *check* tool (run the
tests, execute the code, search for the answer) that passes or fails. A pass ends the
trajectory with a final answer; a failure starts another attempt, and the model thinks
longer after each failure. How likely a check is to pass is a property of the prompt
(a Beta-distributed solve rate), so hard prompts produce long, many-turn trajectories:
the heavy tail, and the reason a failing check predicts a long remainder. See
``libra/emulation/workloads/README.md`` for every field.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Literal

from pydantic import Field, PositiveFloat, PositiveInt, model_validator

from libra.config import Section


class LogNormal(Section):
    """A lognormal quantity: ``median * exp(sigma * N(0, 1))``, clamped to [min, max]."""

    median: PositiveFloat
    sigma: float = Field(0.0, ge=0)
    min: float = Field(0.0, ge=0)
    max: float | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _check_bounds(self) -> LogNormal:
        if self.max is not None and self.max < self.min:
            raise ValueError("max must be at least min")
        return self

    def draw(self, rng: random.Random, scale: float = 1.0) -> float:
        value = self.median * math.exp(self.sigma * rng.gauss(0.0, 1.0)) * scale
        value = max(self.min, value)
        return value if self.max is None else min(self.max, value)


class Rollout(Section):
    prompts: PositiveInt = Field(description="prompts per RL step")
    samples_per_prompt: PositiveInt = Field(description="trajectories per prompt (GRPO group)")
    dataset_prompts: PositiveInt | None = Field(
        None, description="size of the prompt pool; None: every step draws fresh prompts"
    )
    history_steps: int = Field(
        2, ge=0, description="earlier steps whose finished trajectories the policies have seen"
    )
    drift_per_step: float = Field(
        0.0, ge=-0.5, le=1.0, description="relative growth of every model turn per RL step"
    )
    solve_rate_drift_per_step: float = Field(
        0.0,
        ge=-0.5,
        le=1.0,
        description="relative growth of every prompt's solve rate per RL step (capped at 1)",
    )


class Limits(Section):
    max_turns: PositiveInt = Field(description="model turns per trajectory, final answer included")
    max_context_tokens: PositiveInt = Field(description="prompt + everything after it")
    tool_timeout_s: PositiveFloat = Field(60.0, description="a tool running longer times out")


class SolveRate(Section):
    """Per-prompt probability that one check passes: ``Beta(alpha, beta)``."""

    alpha: PositiveFloat
    beta: PositiveFloat
    give_up: float = Field(
        0.0, ge=0, le=1, description="probability of answering anyway after a failed check"
    )


class Turns(Section):
    tokens: LogNormal = Field(description="output tokens of a model turn that calls a tool")
    final_tokens: LogNormal = Field(description="output tokens of the final answer")
    growth_after_failure: float = Field(
        1.0, ge=1.0, description="each failed check multiplies later turns' tokens by this"
    )

    @model_validator(mode="after")
    def _check_room_for_a_tool_call(self) -> Turns:
        if self.tokens.min < MIN_TOOL_TURN_TOKENS:
            raise ValueError(f"turn.tokens.min must be at least {MIN_TOOL_TURN_TOKENS}")
        if self.final_tokens.min < 1:
            raise ValueError("turn.final_tokens.min must be at least 1")
        return self


#: Tokens of a tool call's JSON (in the emulator's byte-level tokens) plus the end token.
MIN_TOOL_TURN_TOKENS = 96


class Output(Section):
    """What a tool returns: its status and its length in characters."""

    status: Literal["success", "failure"] = "success"
    chars: LogNormal


class ExploreTool(Section):
    """A tool the model calls to gather information before a check."""

    name: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    description: str = "Gather information for the task."
    calls_first_attempt: tuple[int, int] = Field((1, 3), description="range, inclusive")
    calls_later_attempts: tuple[int, int] = Field((0, 1), description="range, inclusive")
    latency_s: LogNormal
    output: Output
    failure_probability: float = Field(0.0, ge=0, le=1)
    failure_output: Output | None = None

    @model_validator(mode="after")
    def _check(self) -> ExploreTool:
        for low, high in (self.calls_first_attempt, self.calls_later_attempts):
            if not 0 <= low <= high:
                raise ValueError("call ranges must be (low, high) with 0 <= low <= high")
        if self.failure_probability > 0 and self.failure_output is None:
            raise ValueError("failure_probability needs a failure_output")
        return self


class CheckTool(Section):
    """The tool whose outcome decides whether the attempt solved the task."""

    name: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    description: str = "Check the current solution."
    latency_s: LogNormal
    on_pass: Output
    on_fail: Output
    timeout_probability: float = Field(
        0.0, ge=0, le=1, description="the check hangs past the tool timeout (a failed attempt)"
    )


class Workload(Section):
    name: str = Field(pattern=r"^[a-z0-9][a-z0-9_-]*$")
    description: str = ""
    sources: list[str] = Field(default_factory=list)
    rollout: Rollout
    limits: Limits
    prompt_tokens: LogNormal
    solve_rate: SolveRate
    turn: Turns
    explore: list[ExploreTool] = Field(default_factory=list)
    check: CheckTool

    @model_validator(mode="after")
    def _check(self) -> Workload:
        names = [tool.name for tool in self.explore]
        if len(set(names)) != len(names):
            raise ValueError("explore tool names must be unique")
        if self.limits.max_turns < 2:
            raise ValueError("limits.max_turns must allow a tool turn and a final answer")
        smallest = self.prompt_tokens.min or self.prompt_tokens.median
        if smallest >= self.limits.max_context_tokens:
            raise ValueError("prompts must fit limits.max_context_tokens")
        return self

    @property
    def trajectories_per_step(self) -> int:
        return self.rollout.prompts * self.rollout.samples_per_prompt

    @property
    def history_steps(self) -> int:
        return self.rollout.history_steps

    @property
    def tool_names(self) -> list[str]:
        """Distinct tool names (the check may reuse an explore tool's name, as an agent
        with one code interpreter does)."""
        return list(dict.fromkeys([*(tool.name for tool in self.explore), self.check.name]))


class MixPart(Section):
    """One workload of a mixed step, and how many of the step's prompts are its."""

    workload: str = Field(description="a shipped workload's name, or a workload file")
    prompts: PositiveInt = Field(description="its prompts per RL step")


class MixFile(Section):
    """A mixture file: one RL step drawing prompts from several workloads."""

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9_-]*$")
    description: str = ""
    sources: list[str] = Field(default_factory=list)
    history_steps: int = Field(
        2, ge=0, description="earlier steps whose finished trajectories the policies have seen"
    )
    mix: list[MixPart] = Field(min_length=2)


@dataclass(frozen=True)
class Mix:
    """A step of several workloads (``parts``: each with the mixture's prompts and
    history), each trajectory played by its own workload (its samples per prompt, turns,
    tools and limits) and named by it, as an env mixture's are. The engine and the servers
    get the largest of the parts' limits."""

    name: str
    parts: tuple[Workload, ...]
    history_steps: int

    @property
    def limits(self) -> Limits:
        return Limits(
            max_turns=max(p.limits.max_turns for p in self.parts),
            max_context_tokens=max(p.limits.max_context_tokens for p in self.parts),
            tool_timeout_s=max(p.limits.tool_timeout_s for p in self.parts),
        )

    @property
    def trajectories_per_step(self) -> int:
        return sum(part.trajectories_per_step for part in self.parts)
