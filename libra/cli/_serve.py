"""``libra serve``: the gateway, one OpenAI-compatible endpoint for a whole fleet.

It opens the fleet it is given (``--server emulated|embedded|URL[,URL...]`` or a
``[fleet]`` of buckets, as ``libra rollout`` does), builds the scheduler (``--policy``,
C-MLFQ's saved forest), the engine and the gateway's core over them, and serves the
gateway's ASGI app with uvicorn until Ctrl-C or SIGTERM. Clients point the ``openai``
SDK's ``base_url`` at ``http://HOST:PORT/v1``. A one-line console view shows the
traffic once a second.
"""

from __future__ import annotations

import argparse
import signal
import time
from contextlib import nullcontext
from dataclasses import replace
from functools import partial
from pathlib import Path

import anyio
import uvicorn
from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt
from rich.console import Console
from rich.live import Live

from libra.cli._config import add_config_arguments
from libra.cli._view import add_view_arguments, view_options
from libra.config import load_config
from libra.emulation import EmulatorConfig
from libra.engine import EngineConfig, TransportName
from libra.events import EventBus
from libra.fleet import FleetSpec
from libra.gateway import (
    DEFAULT_MAX_BODY_BYTES,
    GatewayConfig,
    GatewayMetrics,
    GatewayServer,
    Keys,
    Sessions,
    Totals,
    create_gateway,
    gateway_keys,
    uvicorn_config,
)
from libra.launch import (
    SCHEDULERS,
    SchedulerName,
    ViewOptions,
    assemble_engine,
    local_templates,
    run_events,
)
from libra.sched.policies import CMLFQConfig
from libra.serving import SupervisorConfig
from libra.view import RecordFiles


class ServeConfig(BaseModel):
    """``libra serve``'s settings (TOML with ``--config``, ``--set KEY=VALUE``)."""

    model_config = ConfigDict(extra="forbid")

    server: str | None = Field(None, description="emulated (default), embedded or URL(s)")
    fleet: FleetSpec | None = Field(None, description="instances and buckets, not --server")
    model: str | None = Field(None, description="model name upstream (default: the server's)")
    policy: SchedulerName = Field("cmlfq", description=f"one of {', '.join(SCHEDULERS)}")
    cmlfq: CMLFQConfig = CMLFQConfig()
    scheduler_state: Path | None = Field(
        None, description="C-MLFQ's prefix forest: read at start if it exists, written at exit"
    )
    metrics_interval_s: PositiveFloat | None = Field(
        None,
        description="read each server's vLLM /metrics this often, for servers that other "
        "clients use too (the router's own counts miss their load); None: never",
    )
    probe_timeout_s: PositiveFloat = Field(
        10.0, description="how long a server given by URL may take to list its models"
    )
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
    gateway: GatewayConfig = GatewayConfig()
    supervisor: SupervisorConfig = SupervisorConfig()


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "serve", help="the gateway: one OpenAI-compatible endpoint for a fleet, C-MLFQ behind it"
    )
    parser.add_argument(
        "--server", help="'emulated' (default), 'embedded' or OpenAI-compatible URL(s)"
    )
    parser.add_argument("--model", help="model name upstream (default: the server's)")
    parser.add_argument("--policy", help=f"routing policy: {', '.join(SCHEDULERS)} (cmlfq)")
    parser.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port (default 8080; 0: any free one)")
    parser.add_argument("--record", type=Path, help="JSONL file of the sessions as trajectories")
    parser.add_argument(
        "--no-auth", action="store_true", help="no API key (only on a loopback address)"
    )
    parser.add_argument(
        "--api-key-file", type=Path, help="user keys, one a line (else $LIBRA_API_KEY)"
    )
    parser.add_argument(
        "--admin-key-file", type=Path, help="admin keys, one a line (else $LIBRA_ADMIN_KEY)"
    )
    parser.add_argument("--no-console", action="store_true", help="no console view")
    add_view_arguments(parser)
    add_config_arguments(parser, "these settings and more", "gateway.session_ttl_s=60")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    flags = {
        "server": args.server,
        "model": args.model,
        "policy": args.policy,
        "host": args.host,
        "port": args.port,
        "record": args.record,
        "no_auth": True if args.no_auth else None,
        "api_key_file": args.api_key_file,
        "admin_key_file": args.admin_key_file,
        "console": False if args.no_console else None,
    }
    config = load_config(ServeConfig, args.config, flags, args.set)
    keys = gateway_keys(
        config.host,
        no_auth=config.no_auth,
        api_key_file=config.api_key_file,
        admin_key_file=config.admin_key_file,
    )
    view = view_options(args)
    if view is not None and keys.admins:  # off loopback, the gateway's admin keys open it
        admin = partial(keys.check, admin=True)
        view = replace(view, allows=lambda key: admin(b"Bearer " + key.encode()) == "ok")
    anyio.run(serve, config, keys, view, backend_options={"use_uvloop": True})
    return 0


async def serve(config: ServeConfig, keys: Keys, view: ViewOptions | None = None) -> None:
    """Serve until SIGINT or SIGTERM; then stop taking requests, end every session
    (recorded) and save the scheduler's state. The fleet is assembled as a rollout's
    is (``libra.launch``): a server started for it is restarted when it dies or hangs.
    With ``view``, the live view is served too; its events go beside the recorded
    sessions (``FILE.events.jsonl``), whose conversations it shows."""
    bus = EventBus()  # /metrics counts what it publishes; the view, when on, shows it
    record = config.record
    log = record.with_name(record.stem + ".events.jsonl") if record is not None else None
    found = RecordFiles(lambda: [record] if record is not None and record.is_file() else [])
    async with (
        run_events(bus, log=log, view=view, find_record=found) if view else nullcontext(),
        assemble_engine(config, config.policy, templates=local_templates(), events=bus) as run,
    ):
        scheduler = run.engine.scheduler
        gateway = config.gateway
        if config.record is not None:
            gateway = gateway.model_copy(update={"record_path": config.record})
        async with Sessions(run.engine, gateway) as core:
            metrics = GatewayMetrics(scheduler.router, bus)
            app = create_gateway(
                core,
                keys,
                metrics=metrics,
                max_body_bytes=config.max_body_bytes,
                any_model=gateway.any_model,
            )
            server = GatewayServer(uvicorn_config(app, config.host, config.port))
            async with anyio.create_task_group() as group:
                group.start_soon(_stop_on_signal, server)
                group.start_soon(_announce, server, config, keys)
                if config.console:
                    group.start_soon(console_view, metrics, core, config.console_every_s)
                await server.serve()
                group.cancel_scope.cancel()


async def _stop_on_signal(server: uvicorn.Server) -> None:
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for _ in signals:
            server.should_exit = True
            return


async def _announce(server: GatewayServer, config: ServeConfig, keys: Keys) -> None:
    """Print the endpoint once uvicorn listens (the port, when ``port`` was 0)."""
    await server.listening.wait()
    if not server.started:  # it could not bind: uvicorn said why
        return
    port = server.port
    auth = "API key required" if keys.enabled else "no auth (loopback)"
    print(f"libra serve: http://{config.host}:{port}/v1 ({config.policy}, {auth})", flush=True)


async def console_view(
    metrics: GatewayMetrics, core: Sessions, every_s: float, console: Console | None = None
) -> None:
    """One line, redrawn every ``every_s``: requests, their rate, errors, sessions, calls
    upstream, tokens. Nothing on a console that is not a terminal (a log file)."""
    console = console or Console(stderr=True)
    if not console.is_terminal:
        return
    last, last_time = 0, time.monotonic()
    with Live("", console=console, auto_refresh=False, transient=False) as live:
        while True:
            await anyio.sleep(every_s)
            totals, now = metrics.totals, time.monotonic()
            rate = (totals.requests - last) / max(now - last_time, 1e-9)
            last, last_time = totals.requests, now
            live.update(_line(totals, rate, core), refresh=True)


def _line(totals: Totals, rate: float, core: Sessions) -> str:
    in_flight = sum(i.in_flight for i in core.engine.scheduler.router.instances)
    return (
        f"[bold]libra serve[/] {totals.requests} requests ({rate:.0f}/s) · "
        f"[red]{totals.errors} errors[/] · {totals.in_progress} in progress · "
        f"{len(core)} sessions · {in_flight} upstream calls · "
        f"{totals.prompt_tokens} prompt + {totals.completion_tokens} completion tokens"
    )
