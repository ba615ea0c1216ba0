"""A rollout's parts, assembled: fleet, client, scheduler, sandboxes and the engine."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt, model_validator

from libra.envs import Env
from libra.events import EventBus
from libra.launch._engine import Assembled, EngineSettings, assemble_engine
from libra.launch._sandboxes import SandboxKind, open_sandboxes, warm_up
from libra.sched import Scheduler
from libra.serving import CurrentWeights, ServerProcess


class EnvShare(BaseModel):
    """One env of a ``libra train`` mixture (``rollout.envs``)."""

    model_config = ConfigDict(extra="forbid")

    env: str = Field(description="a registered name (see libra envs) or module:Class")
    weight: PositiveFloat = Field(1.0, description="how often a step's prompt is this env's")
    tasks: Path | None = Field(None, description="its JSONL task file (default: seeded tasks)")


class RolloutConfig(EngineSettings):
    """``libra rollout``'s settings, and ``[rollout]`` of ``libra train``."""

    env: str | None = Field(
        None,
        description="the env: a registered name (see libra envs) or module:Class; with an "
        "agent, the env whose reward scores the episodes the agent returns no reward for",
    )
    envs: list[EnvShare] | None = Field(
        None,
        min_length=1,
        description="libra train: a mixture of envs instead of env, each step's prompts "
        "drawn from it by weight (seeded), each env with its own tasks",
    )
    agent: str | None = Field(
        None,
        description="an agent plays the episodes instead of an env: module:function, an "
        "async def (task, client) returning the reward (see docs/agents.md)",
    )
    agent_timeout_s: PositiveFloat = Field(
        600.0, description="an agent's episode that runs longer fails (agent_timeout)"
    )
    n: PositiveInt | None = Field(
        None, description="trajectories: default 64 of seeded tasks; with tasks, all of them"
    )
    tasks: Path | None = Field(
        None,
        description="JSONL file of tasks (key, seed, payload), each sampled in turn; libra "
        "train plays them in epochs, prompts_per_step a step, each epoch shuffled anew",
    )
    samples_per_prompt: PositiveInt = Field(
        1, description="trajectories per task (libra train sets it each step)"
    )
    max_failed_fraction: float = Field(
        1.0,
        ge=0.0,
        le=1.0,
        description="the run fails (exit status 1) when more of its trajectories than this "
        "failed; one in which every trajectory failed always does",
    )
    seed: int = Field(
        0,
        description="seed of the task sampler (unused with tasks); libra train seeds its "
        "steps with its own seed",
    )
    out: Path = Field(
        Path("rollout.jsonl"),
        description="JSONL file of the records, one a line as each trajectory ends (libra "
        "train writes rollouts/ in its run_dir)",
    )
    plot: Path | None = Field(None, description="PNG of calls in flight and trajectories ended")
    progress: bool = Field(True, description="a progress bar on stderr")
    sandbox: SandboxKind = Field(
        "auto",
        description="where tools run code: docker, bwrap (bubblewrap), or auto: Docker if "
        "its engine answers, else bwrap",
    )
    sandbox_pool: PositiveInt = Field(
        16,
        description="Docker: idle containers kept per sandbox spec; at most this many are "
        "started ahead of the trajectories",
    )

    @model_validator(mode="after")
    def _one_way_to_name_the_envs(self) -> RolloutConfig:
        if self.envs is not None:
            given = [key for key in ("env", "agent", "tasks") if getattr(self, key) is not None]
            if given:
                raise ValueError(
                    f"rollout.envs names the envs and their tasks: drop rollout.{given[0]}"
                )
        return self


@asynccontextmanager
async def open_engine(
    config: RolloutConfig,
    envs: Sequence[type[Env]],
    warm: int,
    *,
    servers: Mapping[str, ServerProcess] | None = None,
    weights: CurrentWeights | None = None,
    headers: Mapping[str, str] | None = None,
    wrap_scheduler: Callable[[Scheduler], Scheduler] | None = None,
    events: EventBus | None = None,
) -> AsyncIterator[Assembled]:
    """Open sandboxes for ``envs`` and the fleet (``warm`` containers start while the
    servers do), build the scheduler (from its saved state) and the engine; poll the
    servers' metrics if asked. The servers started for this run (the fleet's own, and
    ``servers`` the caller started, by instance name) are supervised: restarted when
    they die or hang, with ``weights`` (default: the weights they start on).
    ``headers`` go with every request to the servers (a gateway's ``Authorization``).
    The engine routes through ``wrap_scheduler(scheduler)`` if given (one that also
    times every call, say). With ``events``, the engine and the fleet publish there. On
    exit the scheduler's state is saved and everything is closed."""
    async with (
        open_sandboxes(envs, config.sandbox, config.sandbox_pool) as sandboxes,
        assemble_engine(
            config,
            sandboxes=sandboxes,
            # Containers start (seconds each, cold) while vLLM does, not after it.
            while_starting=partial(warm_up, sandboxes, envs, warm),
            servers=servers,
            weights=weights,
            headers=headers,
            wrap_scheduler=wrap_scheduler,
            events=events,
        ) as assembled,
    ):
        yield assembled
