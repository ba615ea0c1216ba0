"""``libra serve``'s run: the gateway, one OpenAI-compatible endpoint for a whole fleet.

It opens the fleet it is given (``server``: emulated, embedded or URLs, or a ``[fleet]``
of buckets, as a rollout does), builds the scheduler (C-MLFQ by default, from its saved
forest), the engine and the gateway over them (:func:`open_gateway`), and serves until
SIGINT or SIGTERM. Clients point the ``openai`` SDK's ``base_url`` at
``http://HOST:PORT/v1``.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Coroutine
from contextlib import nullcontext
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import anyio
from pydantic import Field, PositiveFloat, PositiveInt, model_validator

from libra.config import renamed_key
from libra.events import EventBus
from libra.gateway import (
    DEFAULT_MAX_BODY_BYTES,
    GatewayConfig,
    GatewayMetrics,
    Keys,
    Sessions,
    gateway_keys,
)
from libra.launch._engine import EngineSettings, assemble_engine
from libra.launch._fleet import local_templates
from libra.launch._gateway import open_gateway
from libra.launch._scheduler import SCHEDULERS, SchedulerName
from libra.launch._view import ViewOptions, run_events
from libra.view import RecordFiles

#: What a front end watches a served gateway with (``libra serve``'s console line).
Watch = Callable[[GatewayMetrics, Sessions], Coroutine[Any, Any, None]]


class ServeConfig(EngineSettings):
    """``libra serve``'s settings (TOML with ``--config``, ``--set KEY=VALUE``)."""

    scheduler: SchedulerName = Field("cmlfq", description=f"one of {', '.join(SCHEDULERS)}")
    host: str = Field(
        "127.0.0.1", description="address to listen on (no_auth only on a loopback one)"
    )
    port: int = Field(8080, ge=0, le=65535, description="0: any free port (printed)")
    record: Path | None = Field(None, description="append every ended session here (JSONL)")
    no_auth: bool = Field(False, description="no API key (allowed on loopback only)")
    api_key_file: Path | None = Field(None, description="user keys, one a line")
    admin_key_file: Path | None = Field(None, description="admin keys, one a line")
    max_body_bytes: PositiveInt = Field(
        DEFAULT_MAX_BODY_BYTES, description="larger request bodies are refused (HTTP 413)"
    )
    console: bool = Field(True, description="a one-line view of the traffic, once a second")
    console_every_s: PositiveFloat = Field(
        1.0, description="seconds between redraws of the console view"
    )
    gateway: GatewayConfig = GatewayConfig()

    @model_validator(mode="before")
    @classmethod
    def _policy_is_scheduler(cls, data: Any) -> Any:
        return renamed_key(data, "policy", "scheduler")

    def keys(self) -> Keys:
        """The API keys the gateway checks (its files, else the environment)."""
        return gateway_keys(
            self.host,
            no_auth=self.no_auth,
            api_key_file=self.api_key_file,
            admin_key_file=self.admin_key_file,
        )


async def serve(
    config: ServeConfig, view: ViewOptions | None = None, *, watch: Watch | None = None
) -> None:
    """Serve until SIGINT or SIGTERM; then stop taking requests, end every session
    (recorded) and save the scheduler's state. A server started for it is restarted
    when it dies or hangs. With ``view``, the live view is served too (off loopback, the
    gateway's admin keys open it); its events go beside the recorded sessions
    (``FILE.events.jsonl``), whose conversations it shows. ``watch`` runs beside the
    gateway (a console view)."""
    keys = config.keys()
    if view is not None and keys.admins:
        admin = partial(keys.check, admin=True)
        view = replace(view, allows=lambda key: admin(b"Bearer " + key.encode()) == "ok")
    bus = EventBus()  # /metrics counts what it publishes; the view, when on, shows it
    record = config.record
    log = record.with_name(record.stem + ".events.jsonl") if record is not None else None
    found = RecordFiles(lambda: [record] if record is not None and record.is_file() else [])
    gateway = config.gateway
    if record is not None:
        gateway = gateway.model_copy(update={"record_path": record})
    async with (
        run_events(bus, log=log, view=view, find_record=found) if view else nullcontext(),
        assemble_engine(config, templates=local_templates(), events=bus) as run,
        open_gateway(
            run.engine,
            gateway,
            keys,
            host=config.host,
            port=config.port,
            metrics=GatewayMetrics(run.scheduler.router, bus),
            max_body_bytes=config.max_body_bytes,
        ) as served,
        anyio.create_task_group() as group,
    ):
        auth = "API key required" if keys.enabled else "no auth (loopback)"
        print(f"libra serve: {served.url}/v1 ({config.scheduler}, {auth})", flush=True)
        if watch is not None and served.metrics is not None:
            group.start_soon(watch, served.metrics, served.sessions)
        await _signalled()
        group.cancel_scope.cancel()


async def _signalled() -> None:
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for _ in signals:
            return
