"""``--view [PORT]`` on ``libra rollout``, ``libra train`` and ``libra serve``, and
``libra view PATH``: a finished run's events log replayed in the same page."""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

import anyio

from libra.config import UsageError
from libra.events import EVENTS_FILE
from libra.launch import ViewOptions
from libra.view import History, RecordFiles, serve_view, view_key


def add_view_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--view",
        nargs="?",
        type=int,
        const=0,
        metavar="PORT",
        help="serve the live view of the run (PORT, default any free one; its URL is printed)",
    )
    parser.add_argument(
        "--view-host",
        default="127.0.0.1",
        help="where the view listens (default loopback; elsewhere it needs a key)",
    )
    parser.add_argument(
        "--view-key", help="the key the view asks for (off loopback: one is made if none)"
    )


def view_options(args: argparse.Namespace) -> ViewOptions | None:
    if args.view is None:
        return None
    return ViewOptions(args.view, args.view_host, args.view_key)


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "view", help="the view of a finished run: a run folder or a rollout's events log"
    )
    parser.add_argument(
        "path", type=Path, help=f"a run folder (its {EVENTS_FILE}) or a FILE.events.jsonl"
    )
    parser.add_argument("--port", type=int, default=0, help="default: any free one")
    parser.add_argument("--host", default="127.0.0.1", help="default loopback")
    parser.add_argument("--key", help="the key the view asks for (off loopback: made if none)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    log, records = sources(args.path)
    history = History(live=False, find_record=RecordFiles(lambda: records))
    history.replay(log)
    key = view_key(args.host, args.key)
    anyio.run(partial(_serve, history, args.host, args.port, key))
    return 0


def sources(path: Path) -> tuple[Path, list[Path]]:
    """The events log at ``path`` and the record files beside it."""
    if path.is_dir():
        log = path / EVENTS_FILE
        records = sorted(path.glob("rollouts/*.jsonl")) + sorted(path.glob("eval/*.jsonl"))
    else:
        log = path
        records = [path.with_name(path.name.removesuffix(".events.jsonl") + ".jsonl")]
    if not log.is_file():
        raise UsageError(f"{log} does not exist: no events log to view")
    return log, [file for file in records if file.is_file()]


async def _serve(history: History, host: str, port: int, key: str | None) -> None:
    async with serve_view(history, host, port, key) as url:
        print(f"libra view: {url} (Ctrl-C to stop)", file=sys.stderr, flush=True)
        await anyio.sleep_forever()
