"""``libra rollout``: run an env's trajectories against a server, write them as JSONL."""

from __future__ import annotations

import argparse
import signal
import sys
from contextlib import AsyncExitStack
from functools import partial
from pathlib import Path

import anyio
import msgspec
from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt, field_validator

from libra.cli._config import ConfigError, add_config_arguments, load_config
from libra.cli._fleet import open_fleet
from libra.cli._progress import rollout_progress, summary
from libra.cli._sandboxes import SandboxKind, beside, open_sandboxes, warm_up
from libra.cli._timeline import Timeline, plot_timeline, record_timeline
from libra.emulation import EmulatorConfig
from libra.engine import (
    Engine,
    EngineConfig,
    OpenAIClient,
    RolloutStats,
    TrajectoryRecord,
    TransportName,
    jobs_for,
    rollout,
)
from libra.envs import load_env
from libra.sched import (
    CMLFQ,
    ORACLES,
    POLICIES,
    CMLFQConfig,
    FleetSpec,
    PrefixForest,
    RoutedPolicy,
    Scheduler,
    TreePredictor,
    make_policy,
    poll_metrics,
)

# Every policy but the oracles, which need the true lengths: only the benchmark has them.
SCHEDULERS = [p for p in POLICIES if p not in ORACLES]


class RolloutConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    env: str
    server: str | None = Field(None, description="emulated (default), embedded or URL(s)")
    fleet: FleetSpec | None = Field(None, description="instances and buckets, not --server")
    scheduler: str = Field("least-loaded", description=f"one of {', '.join(SCHEDULERS)}")
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
    n: PositiveInt = 64
    samples_per_prompt: PositiveInt = 1
    seed: int = 0
    out: Path = Path("rollout.jsonl")
    plot: Path | None = Field(None, description="PNG of calls in flight and trajectories ended")
    transport: TransportName = "aiohttp"
    max_connections: PositiveInt = 1024
    progress: bool = True
    sandbox: SandboxKind = "auto"
    sandbox_pool: PositiveInt = 16
    engine: EngineConfig = EngineConfig()
    emulator: EmulatorConfig = EmulatorConfig()

    @field_validator("scheduler")
    @classmethod
    def _known_scheduler(cls, name: str) -> str:
        if name not in SCHEDULERS:
            raise ValueError(f"unknown scheduler {name!r}; choose from {', '.join(SCHEDULERS)}")
        return name


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser("rollout", help="run trajectories of an env, write JSONL")
    parser.add_argument("--env", help="env name (see `libra envs`) or module:Class")
    parser.add_argument(
        "--server", help="'emulated' (default), 'embedded' or OpenAI-compatible URL(s)"
    )
    parser.add_argument("--model", help="model name to request (default: the server's)")
    parser.add_argument(
        "--scheduler", help="routing policy: least-loaded (default), cmlfq, ... (libra/sched)"
    )
    parser.add_argument("-n", type=int, dest="n", help="number of trajectories (default 64)")
    parser.add_argument("--samples-per-prompt", type=int, help="trajectories per task")
    parser.add_argument("--concurrency", type=int, help="trajectories in flight")
    parser.add_argument("--seed", type=int, help="seed of the task sampler")
    parser.add_argument("--out", type=Path, help="output JSONL file (default rollout.jsonl)")
    parser.add_argument("--plot", type=Path, help="PNG of the rollout's progress over time")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--sandbox", choices=["auto", "docker", "bwrap"], help="where tools run code (auto)"
    )
    add_config_arguments(parser, "these settings and more", "engine.max_turns=4")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    flags = {
        "env": args.env,
        "server": args.server,
        "model": args.model,
        "scheduler": args.scheduler,
        "n": args.n,
        "samples_per_prompt": args.samples_per_prompt,
        "seed": args.seed,
        "out": args.out,
        "plot": args.plot,
        "engine.concurrency": args.concurrency,
        "progress": False if args.no_progress else None,
        "sandbox": args.sandbox,
    }
    config = load_config(RolloutConfig, args.config, flags, args.set)
    stats = anyio.run(run_rollout, config, backend_options={"use_uvloop": True})
    print(summary(stats))
    print(f"wrote {stats.done} records to {config.out}")
    if config.plot is not None:
        print(f"plotted its progress in {config.plot}")
    if stats.interrupted:
        print(
            "libra: interrupted; trajectories in flight were recorded as cancelled", file=sys.stderr
        )
        return 130
    return 0


async def run_rollout(config: RolloutConfig) -> RolloutStats:
    env_cls = load_env(config.env)
    env_name = config.env if ":" not in config.env else env_cls.__name__.lower()
    jobs = jobs_for(
        env_cls, env_name, config.n, samples_per_prompt=config.samples_per_prompt, seed=config.seed
    )
    encoder = msgspec.json.Encoder()
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
        )
        # Containers start (seconds each, cold) while vLLM does, not after it.
        warm = min(config.sandbox_pool, config.engine.concurrency, len(jobs))
        fleet = await beside(
            partial(stack.enter_async_context, opening), partial(warm_up, sandboxes, env_cls, warm)
        )
        engine = Engine(
            OpenAIClient(fleet.http, timeout_s=config.engine.request_timeout_s),
            scheduler := _scheduler(config, fleet.spec),
            config=config.engine,
            sandboxes=sandboxes,
        )
        stats = RolloutStats(total=len(jobs))
        timeline = Timeline()
        with config.out.open("wb") as out, rollout_progress(stats, enabled=config.progress) as tick:

            def write(record: TrajectoryRecord) -> None:
                out.write(encoder.encode(record) + b"\n")
                out.flush()
                tick()

            async with anyio.create_task_group() as group:
                group.start_soon(_stop_on_signal, group.cancel_scope, stats)
                if config.plot is not None:
                    group.start_soon(record_timeline, timeline, scheduler, stats)
                interval = config.metrics_interval_s
                if interval is not None and isinstance(scheduler, RoutedPolicy):
                    get = partial(fleet.http.get, timeout_s=min(interval, 10.0))
                    group.start_soon(poll_metrics, scheduler.router, get, interval)
                await rollout(jobs, engine, on_record=write, stats=stats)
                group.cancel_scope.cancel()
    if config.plot is not None:
        timeline.sample(stats.elapsed_s, scheduler, stats)  # the end state
        title = f"libra rollout: {env_name}, {len(jobs)} trajectories, {config.scheduler}"
        plot_timeline(timeline, config.plot, title, _labels(fleet.spec))
    if isinstance(scheduler, CMLFQ) and scheduler.forest and config.scheduler_state:
        scheduler.forest.save(config.scheduler_state)
    return stats


def _labels(fleet: FleetSpec) -> dict[str, str]:
    """Instance names, with their bucket's where there are several buckets."""
    if len(fleet.buckets) == 1:
        return {}
    return {name: f"{name} ({b.name})" for b in fleet.buckets for name in b.instances}


def _scheduler(config: RolloutConfig, fleet: FleetSpec) -> Scheduler:
    scheduler = make_policy(config.scheduler, fleet, config=config.cmlfq)
    state = config.scheduler_state
    if isinstance(scheduler, CMLFQ) and state is not None and state.exists():
        try:
            scheduler.predictor = TreePredictor(PrefixForest.load(state))
        except (ValueError, msgspec.DecodeError) as exc:
            message = f"scheduler_state {state} is not a saved prefix forest: {exc}"
            raise ConfigError(message) from None
    return scheduler


async def _stop_on_signal(scope: anyio.CancelScope, stats: RolloutStats) -> None:
    """Ctrl-C or SIGTERM cancels the rollout; every trajectory in flight is still recorded."""
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for _ in signals:
            stats.interrupted = True
            scope.cancel()
            return
