"""``libra serve``'s flags, and its console view: a line of traffic once a second.
The run itself is ``libra.launch.serve``."""

from __future__ import annotations

import argparse
import time
from functools import partial
from pathlib import Path

import anyio
from rich.console import Console
from rich.live import Live

from libra.cli._config import add_config_arguments
from libra.cli._view import add_view_arguments, view_options
from libra.config import load_config, renamed
from libra.launch import SCHEDULERS, GatewayMetrics, ServeConfig, Sessions, serve


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "serve", help="the gateway: one OpenAI-compatible endpoint for a fleet, C-MLFQ behind it"
    )
    parser.add_argument(
        "--server", help="'emulated' (default), 'embedded' or OpenAI-compatible URL(s)"
    )
    parser.add_argument("--model", help="model name upstream (default: the server's)")
    parser.add_argument("--scheduler", help=f"routing policy: {', '.join(SCHEDULERS)} (cmlfq)")
    parser.add_argument("--policy", help="the old name of --scheduler")
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
    if args.policy is not None:
        renamed("libra serve --policy", "--scheduler")
    flags = {
        "server": args.server,
        "model": args.model,
        "scheduler": args.scheduler or args.policy,
        "host": args.host,
        "port": args.port,
        "record": args.record,
        "no_auth": True if args.no_auth else None,
        "api_key_file": args.api_key_file,
        "admin_key_file": args.admin_key_file,
        "console": False if args.no_console else None,
    }
    config = load_config(ServeConfig, args.config, flags, args.set)
    watch = partial(console_view, every_s=config.console_every_s) if config.console else None
    anyio.run(
        partial(serve, config, view_options(args), watch=watch),
        backend_options={"use_uvloop": True},
    )
    return 0


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
            live.update(_line(metrics, rate, core), refresh=True)


def _line(metrics: GatewayMetrics, rate: float, core: Sessions) -> str:
    totals = metrics.totals
    in_flight = sum(i.in_flight for i in core.engine.scheduler.router.instances)
    return (
        f"[bold]libra serve[/] {totals.requests} requests ({rate:.0f}/s) · "
        f"[red]{totals.errors} errors[/] · {totals.in_progress} in progress · "
        f"{len(core)} sessions · {in_flight} upstream calls · "
        f"{totals.prompt_tokens} prompt + {totals.completion_tokens} completion tokens"
    )
