"""A rollout's parts, assembled: fleet, client, scheduler, sandboxes and the engine."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import anyio
from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt

from libra.emulation import EmulatorConfig
from libra.engine import Engine, EngineConfig, TransportName
from libra.envs import Env
from libra.fleet import FleetSpec
from libra.launch._fleet import Fleet, open_fleet
from libra.launch._sandboxes import SandboxKind, beside, open_sandboxes, warm_up
from libra.launch._scheduler import (
    SCHEDULERS,
    SchedulerName,
    build_scheduler,
    save_scheduler_state,
)
from libra.sched import Scheduler, poll_metrics
from libra.sched.policies import CMLFQConfig
from libra.serving import CurrentWeights, ServerProcess, ServerSupervisor, SupervisorConfig


class RolloutConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    env: str
    server: str | None = Field(None, description="emulated (default), embedded or URL(s)")
    fleet: FleetSpec | None = Field(None, description="instances and buckets, not --server")
    scheduler: SchedulerName = Field("least-loaded", description=f"one of {', '.join(SCHEDULERS)}")
    cmlfq: CMLFQConfig = CMLFQConfig()
    metrics_interval_s: PositiveFloat | None = Field(
        None,
        description="read each server's vLLM /metrics this often, for servers that other "
        "clients use too (the router's own counts miss their load); None: never",
    )
    scheduler_state: Path | None = Field(
        None,
        description="C-MLFQ's prefix forest: read before the rollout if the file exists, "
        "written after it, so what one step learnt guides the next",
    )
    model: str | None = None
    probe_timeout_s: PositiveFloat = Field(
        10.0, description="how long a server given by URL may take to list its models"
    )
    n: PositiveInt | None = Field(
        None, description="trajectories: default 64 of seeded tasks; with tasks, all of them"
    )
    tasks: Path | None = Field(
        None, description="JSONL file of tasks (key, seed, payload), each sampled in turn"
    )
    samples_per_prompt: PositiveInt = 1
    max_failed_fraction: float = Field(
        1.0,
        ge=0.0,
        le=1.0,
        description="the run fails (exit status 1) when more of its trajectories than this "
        "failed; one in which every trajectory failed always does",
    )
    seed: int = 0
    out: Path = Path("rollout.jsonl")
    plot: Path | None = Field(None, description="PNG of calls in flight and trajectories ended")
    transport: TransportName = "httptools"
    max_connections: PositiveInt = 1024
    progress: bool = True
    sandbox: SandboxKind = "auto"
    sandbox_pool: PositiveInt = 16
    engine: EngineConfig = EngineConfig()
    emulator: EmulatorConfig = EmulatorConfig()
    supervisor: SupervisorConfig = SupervisorConfig()


@dataclass
class Assembled:
    """What a rollout runs on: the engine, and the fleet it routes over."""

    engine: Engine
    fleet: Fleet
    supervisor: ServerSupervisor  # of the servers started for this run (none: idle)
    #: The run's scheduler (the engine's, unless a ``wrap_scheduler`` wrapped it there).
    scheduler: Scheduler


def _waiting_for_restarts(config: RolloutConfig) -> EngineConfig:
    """A supervised server comes back: a call that finds every server down waits out
    its restart rather than fail."""
    wait = max(config.engine.capacity_wait_s, config.supervisor.calls_wait_s)
    return config.engine.model_copy(update={"capacity_wait_s": wait})


def _start_weights() -> tuple[None, int]:
    return None, 0


@asynccontextmanager
async def open_engine(
    config: RolloutConfig,
    env_cls: type[Env],
    warm: int,
    *,
    servers: Mapping[str, ServerProcess] | None = None,
    weights: CurrentWeights | None = None,
    headers: Mapping[str, str] | None = None,
    wrap_scheduler: Callable[[Scheduler], Scheduler] | None = None,
) -> AsyncIterator[Assembled]:
    """Open sandboxes and fleet (``warm`` containers start while the servers do), build
    the scheduler (from its saved state) and the engine; poll the servers' metrics if
    asked. The servers started for this run (the fleet's own, and ``servers`` the caller
    started, by instance name) are supervised: restarted when they die or hang, with
    ``weights`` (default: the weights they start on). ``headers`` go with every request
    to the servers (a gateway's ``Authorization``). The engine routes through
    ``wrap_scheduler(scheduler)`` if given (one that also times every call, say). On exit
    the scheduler's state is saved and everything is closed."""
    async with AsyncExitStack() as stack:
        sandboxes = await stack.enter_async_context(
            open_sandboxes(env_cls, config.sandbox, config.sandbox_pool)
        )
        opening = open_fleet(
            config.server,
            fleet=config.fleet,
            model=config.model,
            transport=config.transport,
            max_connections=config.max_connections,
            emulator=config.emulator,
            probe_timeout_s=config.probe_timeout_s,
            headers=headers,
        )
        # Containers start (seconds each, cold) while vLLM does, not after it.
        fleet = await beside(
            partial(stack.enter_async_context, opening), partial(warm_up, sandboxes, env_cls, warm)
        )
        scheduler = build_scheduler(
            config.scheduler, fleet.spec, config.cmlfq, config.scheduler_state
        )
        for endpoint in scheduler.router.endpoints().values():
            endpoint.headers.update(headers or {})
        owned = {**fleet.servers, **(servers or {})}
        engine = Engine(
            fleet.http,
            scheduler if wrap_scheduler is None else wrap_scheduler(scheduler),
            config=_waiting_for_restarts(config) if owned else config.engine,
            sandboxes=sandboxes,
        )
        supervisor = ServerSupervisor(
            scheduler.router, owned, weights=weights or _start_weights, config=config.supervisor
        )
        async with anyio.create_task_group() as group:
            interval = config.metrics_interval_s
            if interval is not None:  # every scheduler routes over the live fleet
                get = partial(fleet.http.get, timeout_s=min(interval, 10.0))
                group.start_soon(poll_metrics, scheduler.router, get, interval)
            if owned:
                group.start_soon(supervisor.run)
            yield Assembled(engine, fleet, supervisor, scheduler)
            group.cancel_scope.cancel()
        save_scheduler_state(scheduler, config.scheduler_state)
