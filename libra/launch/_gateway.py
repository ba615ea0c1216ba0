"""A gateway over an engine, served on a port: the one assembly of ``libra serve``,
``libra train --online`` and an agent's episodes (``libra.agents``)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

from libra.engine import Engine, TrajectoryRecord
from libra.gateway import (
    DEFAULT_MAX_BODY_BYTES,
    GatewayConfig,
    GatewayMetrics,
    Keys,
    Sessions,
    create_gateway,
    serving,
)


@dataclass(frozen=True)
class OpenGateway:
    """A gateway being served: its base URL (clients call ``{url}/v1``), its core, and
    the counters its ``/metrics`` shows."""

    url: str
    sessions: Sessions
    metrics: GatewayMetrics | None


@asynccontextmanager
async def open_gateway(
    engine: Engine,
    config: GatewayConfig,
    keys: Keys,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    on_end: Callable[[str | None, TrajectoryRecord], None] | None = None,
    episode_of: Callable[[str], str | None] | None = None,
    metrics: GatewayMetrics | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> AsyncIterator[OpenGateway]:
    """Serve the gateway over ``engine`` on ``host:port`` (0: a free port) while the
    block runs. ``on_end`` gets each ended session's record, and ``episode_of`` names
    the episode a client's key belongs to (``libra.gateway.Sessions``); on exit the server
    stops taking requests first, then every session still open ends (recorded)."""
    async with Sessions(engine, config, on_end=on_end, episode_of=episode_of) as sessions:
        app = create_gateway(
            sessions,
            keys,
            metrics=metrics,
            max_body_bytes=max_body_bytes,
            any_model=config.any_model,
        )
        async with serving(app, host, port) as url:
            yield OpenGateway(url, sessions, metrics)
