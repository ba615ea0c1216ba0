"""An engine over a supervised fleet: the assembly ``libra rollout``, ``libra serve`` and
the trainer share (fleet, scheduler and its saved state, supervisor, metrics polling)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Coroutine, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import anyio
from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt

from libra.emulation import EmulatorConfig
from libra.engine import ChatTemplate, Engine, EngineConfig, TransportName
from libra.envs import SandboxProvider
from libra.events import EventBus
from libra.fleet import FleetSpec
from libra.launch._fleet import Fleet, open_fleet
from libra.launch._sandboxes import beside
from libra.launch._scheduler import (
    SCHEDULERS,
    SchedulerName,
    build_scheduler,
    save_scheduler_state,
)
from libra.launch._view import publish_fleet
from libra.sched import Scheduler, poll_metrics
from libra.sched.policies import CMLFQConfig
from libra.serving import CurrentWeights, ServerProcess, ServerSupervisor, SupervisorConfig


class EngineSettings(BaseModel):
    """The settings of an engine over a fleet: the keys ``libra rollout``'s, ``libra
    serve``'s and ``libra train``'s rollout configs share (each subclasses this)."""

    model_config = ConfigDict(extra="forbid")

    server: str | None = Field(None, description="emulated (default), embedded or URL(s)")
    fleet: FleetSpec | None = Field(None, description="instances and buckets, not --server")
    model: str | None = Field(
        None,
        description="model name to request (default: the server's); a [fleet] names it per "
        "instance",
    )
    scheduler: SchedulerName = Field("least-loaded", description=f"one of {', '.join(SCHEDULERS)}")
    cmlfq: CMLFQConfig = CMLFQConfig()
    scheduler_state: Path | None = Field(
        None,
        description="C-MLFQ's prefix forest: read at the start if the file exists, written "
        "at the end (libra train: after each rollout), so what one run learnt guides the next",
    )
    metrics_interval_s: PositiveFloat | None = Field(
        None,
        description="read each server's vLLM /metrics this often, for servers that other "
        "clients use too (the router's own counts miss their load); None: never",
    )
    probe_timeout_s: PositiveFloat = Field(
        10.0, description="how long a server given by URL may take to list its models"
    )
    transport: TransportName = Field(
        "httptools",
        description="HTTP client for servers on real ports (httptools: the least CPU a "
        "call); the emulated server is called in-process",
    )
    max_connections: PositiveInt = Field(
        1024, description="sockets open to all servers together; more calls wait for one"
    )
    engine: EngineConfig = EngineConfig()
    emulator: EmulatorConfig = EmulatorConfig()
    supervisor: SupervisorConfig = SupervisorConfig()


@dataclass
class Assembled:
    """What a run routes through: the engine, and the fleet it routes over."""

    engine: Engine
    fleet: Fleet
    supervisor: ServerSupervisor  # of the servers started for this run (none: idle)
    #: The run's scheduler (the engine's, unless a ``wrap_scheduler`` wrapped it there).
    scheduler: Scheduler


def _waiting_for_restarts(settings: EngineSettings) -> EngineConfig:
    """A supervised server comes back: a call that finds every server down waits out
    its restart rather than fail."""
    wait = max(settings.engine.capacity_wait_s, settings.supervisor.calls_wait_s)
    return settings.engine.model_copy(update={"capacity_wait_s": wait})


def _start_weights() -> tuple[None, int]:
    return None, 0


async def _nothing() -> None:
    pass


@asynccontextmanager
async def assemble_engine(
    settings: EngineSettings,
    *,
    sandboxes: SandboxProvider | None = None,
    while_starting: Callable[[], Coroutine[Any, Any, None]] = _nothing,
    templates: Sequence[ChatTemplate] = (),
    servers: Mapping[str, ServerProcess] | None = None,
    weights: CurrentWeights | None = None,
    headers: Mapping[str, str] | None = None,
    wrap_scheduler: Callable[[Scheduler], Scheduler] | None = None,
    events: EventBus | None = None,
) -> AsyncIterator[Assembled]:
    """Open the fleet (``while_starting`` runs while its servers start), build the
    scheduler ``settings`` names (from its saved state) and the engine; poll the servers'
    metrics if asked. The servers started for this run (the fleet's own, and ``servers``
    the caller started, by instance name) are supervised: restarted when they die or
    hang, with ``weights`` (default: the weights they start on). ``headers`` go with
    every request to the servers (a gateway's ``Authorization``). The engine routes
    through ``wrap_scheduler(scheduler)`` if given (one that also times every call, say).
    With ``events``, the engine publishes its trajectories there, and the fleet is sampled
    onto it every second. On exit the scheduler's state is saved and the fleet is closed."""
    async with AsyncExitStack() as stack:
        opening = open_fleet(
            settings.server,
            fleet=settings.fleet,
            model=settings.model,
            transport=settings.transport,
            max_connections=settings.max_connections,
            emulator=settings.emulator,
            probe_timeout_s=settings.probe_timeout_s,
            headers=headers,
        )
        fleet = await beside(partial(stack.enter_async_context, opening), while_starting)
        scheduler = build_scheduler(
            settings.scheduler, fleet.spec, settings.cmlfq, settings.scheduler_state
        )
        for endpoint in scheduler.router.endpoints().values():
            endpoint.headers.update(headers or {})
        owned = {**fleet.servers, **(servers or {})}
        engine = Engine(
            fleet.http,
            scheduler if wrap_scheduler is None else wrap_scheduler(scheduler),
            config=_waiting_for_restarts(settings) if owned else settings.engine,
            sandboxes=sandboxes,
            templates=templates,
            events=events,
        )
        supervisor = ServerSupervisor(
            scheduler.router, owned, weights=weights or _start_weights, config=settings.supervisor
        )
        async with anyio.create_task_group() as group:
            interval = settings.metrics_interval_s
            if interval is not None:  # every scheduler routes over the live fleet
                get = partial(fleet.http.get, timeout_s=min(interval, 10.0))
                group.start_soon(poll_metrics, scheduler.router, get, interval)
            if owned:
                group.start_soon(supervisor.run)
            if events is not None:
                group.start_soon(publish_fleet, events, scheduler.router)
            yield Assembled(engine, fleet, supervisor, scheduler)
            group.cancel_scope.cancel()
        save_scheduler_state(scheduler, settings.scheduler_state)
