"""``libra rollout``: run an env's trajectories against a server, write them as JSONL."""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

import anyio

from libra.cli._config import add_config_arguments
from libra.cli._output import check_output_file
from libra.cli._progress import rollout_progress, summary
from libra.cli._timeline import Timeline, plot_timeline, record_timeline
from libra.cli._view import add_view_arguments, view_options
from libra.config import load_config
from libra.launch import FleetSpec, RolloutConfig, rollout


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser("rollout", help="run trajectories of an env, write JSONL")
    parser.add_argument("--env", help="env name (see `libra envs`) or module:Class")
    parser.add_argument("--agent", help="an agent plays instead: module:function (async def)")
    parser.add_argument(
        "--server", help="'emulated' (default), 'embedded' or OpenAI-compatible URL(s)"
    )
    parser.add_argument("--model", help="model name to request (default: the server's)")
    parser.add_argument(
        "--scheduler", help="routing policy: least-loaded (default), cmlfq, ... (libra/sched)"
    )
    parser.add_argument(
        "-n", type=int, dest="n", help="number of trajectories (default 64; with --tasks, all)"
    )
    parser.add_argument(
        "--tasks",
        type=Path,
        help="JSONL file of tasks, one {key, seed, payload} object a line (default: seeds)",
    )
    parser.add_argument("--samples-per-prompt", type=int, help="trajectories per task")
    parser.add_argument("--concurrency", type=int, help="trajectories in flight")
    parser.add_argument("--seed", type=int, help="seed of the task sampler")
    parser.add_argument(
        "--max-failed-fraction",
        type=float,
        help="exit with status 1 if more trajectories than this failed (default 1.0: only "
        "when all did)",
    )
    parser.add_argument("--out", type=Path, help="output JSONL file (default rollout.jsonl)")
    parser.add_argument("--plot", type=Path, help="PNG of the rollout's progress over time")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--sandbox", choices=["auto", "docker", "bwrap"], help="where tools run code (auto)"
    )
    add_view_arguments(parser)
    add_config_arguments(parser, "these settings and more", "engine.max_turns=4")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    flags = {
        "env": args.env,
        "agent": args.agent,
        "server": args.server,
        "model": args.model,
        "scheduler": args.scheduler,
        "n": args.n,
        "tasks": args.tasks,
        "samples_per_prompt": args.samples_per_prompt,
        "seed": args.seed,
        "max_failed_fraction": args.max_failed_fraction,
        "out": args.out,
        "plot": args.plot,
        "engine.concurrency": args.concurrency,
        "progress": False if args.no_progress else None,
        "sandbox": args.sandbox,
    }
    config = load_config(RolloutConfig, args.config, flags, args.set)
    check_output_file(config.out, "--out")
    if config.plot is not None:
        check_output_file(config.plot, "--plot")
    timeline = Timeline()
    watch = partial(record_timeline, timeline) if config.plot is not None else None
    progress = partial(rollout_progress, enabled=config.progress)
    rolling = partial(rollout, config, view=view_options(args), progress=progress, watch=watch)
    done = anyio.run(rolling, backend_options={"use_uvloop": True})
    stats, failures = done.stats, done.failures
    print(summary(stats))
    print(f"wrote {stats.done} records to {config.out}")
    if config.plot is not None:
        timeline.sample(stats.elapsed_s, done.scheduler, stats)  # the end
        title = f"libra rollout: {done.title}"
        plot_timeline(timeline, config.plot, title, _labels(done.fleet))
        print(f"plotted its progress in {config.plot}")
    if stats.interrupted:
        print(
            "libra: interrupted; trajectories in flight were recorded as cancelled", file=sys.stderr
        )
        return 130
    if failures.too_many(stats.done, config.max_failed_fraction):
        print(f"libra: error: {failures.describe(stats.done)}", file=sys.stderr)
        return 1
    return 0


def _labels(fleet: FleetSpec) -> dict[str, str]:
    """Instance names, with their bucket's where there are several buckets."""
    if len(fleet.buckets) == 1:
        return {}
    return {name: f"{name} ({b.name})" for b in fleet.buckets for name in b.instances}
