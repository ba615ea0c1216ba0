"""``libra rollout``: run an env's trajectories against a server, write them as JSONL."""

from __future__ import annotations

import argparse
import signal
import sys
from collections import Counter
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import anyio
import msgspec

from libra.cli._config import add_config_arguments
from libra.cli._output import check_output_file, make_parents
from libra.cli._progress import rollout_progress, summary
from libra.cli._timeline import Timeline, plot_timeline, record_timeline
from libra.cli._view import add_view_arguments, view_options
from libra.config import load_config
from libra.engine import (
    RolloutSession,
    RolloutStats,
    TrajectoryJob,
    TrajectoryRecord,
    jobs_for,
    jobs_of,
)
from libra.envs import Env
from libra.events import EventBus
from libra.fleet import FleetSpec
from libra.launch import (
    RolloutConfig,
    ViewOptions,
    load_player,
    open_engine,
    open_session,
    read_tasks,
    run_events,
)
from libra.view import RecordFiles


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
    failures = Failures()
    view = view_options(args)
    stats = anyio.run(
        partial(run_rollout, config, failures=failures, view=view),
        backend_options={"use_uvloop": True},
    )
    print(summary(stats))
    print(f"wrote {stats.done} records to {config.out}")
    if config.plot is not None:
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


@dataclass
class Failures:
    """The failed records of a run: how many, why, and the first one's error."""

    reasons: Counter[str] = field(default_factory=Counter)
    first_error: str | None = None

    def observe(self, record: TrajectoryRecord) -> None:
        if record.status == "failed":
            self.reasons[record.stop_reason] += 1
            if self.first_error is None:
                self.first_error = record.error

    def too_many(self, done: int, max_fraction: float) -> bool:
        failed = self.reasons.total()
        return done > 0 and (failed == done or failed > max_fraction * done)

    def describe(self, done: int) -> str:
        failed = self.reasons.total()
        which = f"all {done}" if failed == done else f"{failed} of {done}"
        reasons = ", ".join(f"{reason}: {n}" for reason, n in self.reasons.most_common())
        first = f"; the first: {self.first_error}" if self.first_error else ""
        return f"{which} trajectories failed ({reasons}){first}"


async def run_rollout(
    config: RolloutConfig, *, failures: Failures | None = None, view: ViewOptions | None = None
) -> RolloutStats:
    """One session, its jobs all submitted at once, and its records written as JSONL
    (and shown to ``failures``). With ``view``, the live view is served and the run's
    events go to ``FILE.events.jsonl`` beside the records (``libra view`` shows them
    again once the rollout has ended)."""
    player = load_player(config)
    env_cls, name = player.env_cls, player.name
    jobs = _jobs(config, env_cls, name)
    encoder = msgspec.json.Encoder()
    warm = min(config.sandbox_pool, config.engine.concurrency, len(jobs))
    timeline = Timeline()
    bus = EventBus() if view is not None else None
    log = make_parents(config.out).with_name(config.out.stem + ".events.jsonl")
    async with (
        run_events(bus, log=log, view=view, find_record=RecordFiles(lambda: [config.out]))
        if bus is not None
        else nullcontext(),
        open_engine(config, [env_cls] if env_cls else [], warm, events=bus) as run,
        open_session(run.engine, config, player) as session,
    ):
        scheduler, stats = run.engine.scheduler, session.stats
        session.submit(jobs)
        session.close()
        with (
            make_parents(config.out).open("wb") as out,
            rollout_progress(stats, enabled=config.progress) as tick,
        ):
            async with anyio.create_task_group() as group:
                group.start_soon(_stop_on_signal, session)
                if config.plot is not None:
                    group.start_soon(record_timeline, timeline, scheduler, stats)
                async for record in session:  # to the end, cancelled ones included
                    out.write(encoder.encode(record) + b"\n")
                    out.flush()
                    if failures is not None:
                        failures.observe(record)
                    tick()
                group.cancel_scope.cancel()
    if config.plot is not None:
        timeline.sample(stats.elapsed_s, scheduler, stats)  # the end state
        title = f"libra rollout: {name}, {len(jobs)} trajectories, {config.scheduler}"
        plot_timeline(timeline, config.plot, title, _labels(run.fleet.spec))
    return stats


def _labels(fleet: FleetSpec) -> dict[str, str]:
    """Instance names, with their bucket's where there are several buckets."""
    if len(fleet.buckets) == 1:
        return {}
    return {name: f"{name} ({b.name})" for b in fleet.buckets for name in b.instances}


def _jobs(config: RolloutConfig, env_cls: type[Env] | None, env_name: str) -> list[TrajectoryJob]:
    """The tasks of ``config.tasks``, each sampled in turn, or ``n`` of seeded tasks."""
    per_prompt = config.samples_per_prompt
    if config.tasks is None:
        n = config.n or 64
        return jobs_for(env_cls, env_name, n, samples_per_prompt=per_prompt, seed=config.seed)
    jobs = jobs_of(env_cls, read_tasks(config.tasks, env_name), samples_per_prompt=per_prompt)
    return jobs[: config.n]


async def _stop_on_signal(session: RolloutSession) -> None:
    """Ctrl-C or SIGTERM cancels the rollout; every trajectory in flight is still recorded
    (and written: the stream ends after their records)."""
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for _ in signals:
            session.stats.interrupted = True
            session.cancel()
            return
