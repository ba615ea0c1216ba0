"""``libra bench sched``: every scheduling policy against one emulated fleet and workload.

For each policy, one RL step of the workload runs through the real engine, HTTP client
and policy against an in-process fleet of emulated vLLM servers (continuous batching
under the fleet's cost model, prefix caching, priority queues), on trio's virtual clock:
a step that would take many GPU-minutes runs in seconds, and the same seed gives the
same numbers. The servers play the fleet's truth (a ``--mismatch`` preset: not the cost
model the scheduler is given). Before the step, each policy is shown the protocol calls
of the workload's earlier steps (``history_steps``), as a running system would have
seen them; the oracles are told every trajectory's future instead (each turn's length
and its tool's seconds).

Reported per policy: throughput (trajectories/s and output tokens/s over the step's
makespan), the makespan, the mean GPU idle fraction, p99/p50 trajectory latency, the
calls that moved to another instance, the requests the servers preempted (their KV ran
short), and the makespan relative to cmlfq's (what an ablation costs), to the oracle's
and to a lower bound that no policy can beat: the larger of the longest trajectory run alone
on the fastest instance (decode, prefill of new tokens and tool time) and the step's
decode work at the fleet's full-batch throughput, both priced with what the servers
really play (under a mismatch preset, its truth less jitter and prefill interference).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor

import anyio

from libra.bench._emulated_fleet import (
    CONTEXT_MARGIN,
    MODEL,
    emulated_servers,
    engine_config,
    in_virtual_time,
    server_config,
)
from libra.bench._sched_bound import lower_bound
from libra.bench._sched_fleet import DEFAULT_MISMATCH, FleetFile, load_fleet, with_mismatch
from libra.bench._sched_history import replay_history, truth_of
from libra.bench._sched_report import (
    PolicyRun,
    SchedReport,
    Timeline,
    plot,
    print_json,
    print_stragglers,
    print_table,
)
from libra.bench._sched_summary import result_of, summarise
from libra.config import load_config
from libra.emulation import EmulatorApp, FleetApp
from libra.emulation.workloads import (
    Book,
    EnvClasses,
    Mix,
    Workload,
    WorkloadError,
    book_of,
    load_step,
)
from libra.engine import ASGITransport, Engine, TrajectoryJob, TrajectoryRecord, rollout
from libra.envs import Task
from libra.sched.policies import ABLATIONS, DEFAULT_POLICIES, POLICIES, CMLFQConfig, make_policy

DEFAULT_WORKLOAD = "swe-agent"


# ------------------------------------------------------------------------ one policy


def run_policy(
    workload: Workload | Mix,
    fleet: FleetFile,
    policy: str,
    seed: int = 0,
    config: CMLFQConfig | None = None,
) -> PolicyRun:
    """One RL step of ``workload`` under ``policy`` (``config`` tunes ``cmlfq``), in
    virtual time; deterministic for a seed."""
    return in_virtual_time(_run_policy, workload, fleet, policy, seed, config, seed=seed)


async def _run_policy(
    workload: Workload | Mix, fleet: FleetFile, name: str, seed: int, config: CMLFQConfig | None
) -> PolicyRun:
    book = book_of(workload, seed)
    step = workload.history_steps
    scripts = book.step(step)
    spec = fleet.spec(MODEL)
    truth = truth_of(scripts)
    policy = make_policy(name, spec, truth=truth, config=config)
    replay_history(policy, book, step)
    apps, timelines = _fleet_apps(workload, fleet, book, seed)
    env_classes = EnvClasses(book)
    jobs = [
        TrajectoryJob(
            env_classes(step, s.sample, s.workload), Task(s.task_id, s.task_seed), s.sample, step
        )
        for s in scripts
    ]
    records: list[TrajectoryRecord] = []
    async with ASGITransport(FleetApp(apps)) as http:
        engine = Engine(http, policy, config=engine_config(workload, len(jobs), seed))
        started = anyio.current_time()
        await rollout(jobs, engine, on_record=records.append)
        makespan = anyio.current_time() - started
    return summarise(name, policy, fleet, apps, timelines, records, makespan, truth)


def _fleet_apps(
    workload: Workload | Mix, fleet: FleetFile, book: Book, seed: int
) -> tuple[dict[str, EmulatorApp], dict[str, Timeline]]:
    """One emulated server per instance, each recording its occupancy."""
    base = server_config(workload, fleet, seed, CONTEXT_MARGIN)
    configs = {
        plan.name: base.model_copy(update={"latency": fleet.latency(plan.tp)})
        for plan in fleet.instances
    }
    apps = emulated_servers(configs, book)
    timelines: dict[str, Timeline] = {}
    for name, app in apps.items():
        timeline = timelines[name] = [(0.0, 0)]
        assert app.engine is not None
        app.engine.observer = _recorder(timeline)
    return apps, timelines


def _recorder(timeline: Timeline) -> Callable[[float, int, int], None]:
    def record(now: float, running: int, waiting: int) -> None:
        if running != timeline[-1][1]:
            timeline.append((now, running))

    return record


# ------------------------------------------------------------------------ all of them


def run_sched_bench(
    workload: Workload | Mix,
    fleet: FleetFile,
    policies: list[str],
    *,
    seed: int = 0,
    fleet_name: str = "",
    jobs: int = 1,
    mismatch: str = DEFAULT_MISMATCH,
    trace: bool = False,
    config: CMLFQConfig | None = None,
) -> SchedReport:
    """Every policy on the same step (``config`` tunes ``cmlfq``); ``jobs`` > 1 runs
    policies in parallel processes (each run is deterministic on its own, so the numbers
    do not change)."""
    if jobs > 1 and len(policies) > 1:
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(min(jobs, len(policies)), mp_context=context) as pool:
            futures = [pool.submit(run_policy, workload, fleet, p, seed, config) for p in policies]
            runs = [future.result() for future in futures]
    else:
        runs = [run_policy(workload, fleet, policy, seed, config) for policy in policies]
    step = workload.history_steps
    scripts = book_of(workload, seed).step(step)
    bound = lower_bound(scripts, fleet)
    oracle = next((run.makespan_s for run in runs if run.policy == "oracle"), None)
    cmlfq = next((run.makespan_s for run in runs if run.policy == "cmlfq"), None)
    return SchedReport(
        workload=workload.name,
        fleet=fleet_name or fleet.name,
        seed=seed,
        step=step,
        trajectories=len(scripts),
        lower_bound=bound,
        results=[result_of(run, bound, oracle, cmlfq) for run in runs],
        runs=runs,
        mismatch=mismatch,
        trace=trace,
    )


def default_jobs() -> int:
    return max(1, min(4, os.cpu_count() or 1))


# ------------------------------------------------------------------- the command line


def main_sched(args: argparse.Namespace) -> int:
    """``libra bench sched``: run, then print the table (or JSON) and draw the plot."""
    try:
        workload = load_step(args.workload)
        fleet = with_mismatch(load_fleet(args.fleet), args.mismatch)
        policies = parse_policies(args.policies, ablate=args.ablate)
        config = load_config(CMLFQConfig, overrides=args.cmlfq) if args.cmlfq else None
    except (WorkloadError, ValueError) as exc:
        print(f"libra: error: {exc}", file=sys.stderr)
        return 2
    report = run_sched_bench(
        workload,
        fleet,
        policies,
        seed=args.seed,
        fleet_name=fleet.name,
        jobs=args.jobs,
        mismatch=args.mismatch,
        trace=args.trace,
        config=config,
    )
    report.cmlfq_settings = tuple(args.cmlfq)
    if args.json:
        print_json(report)
    else:
        print_table(report)
        if args.trace:
            print_stragglers(report)
    if args.plot:
        plot(report, args.plot)
    return 0


def parse_policies(text: str | None, *, ablate: bool = False) -> list[str]:
    """``a,b,c`` into policy names, checked; the default set when empty. ``ablate`` adds
    C-MLFQ's ablations (:data:`ABLATIONS`); the policies then run in the registry's order."""
    names = [name.strip() for name in (text or "").split(",") if name.strip()]
    unknown = [name for name in names if name not in POLICIES]
    if unknown:
        raise ValueError(
            f"unknown policies {', '.join(unknown)}; choose from {', '.join(POLICIES)}"
        )
    chosen = list(dict.fromkeys(names)) if names else list(DEFAULT_POLICIES)
    if not ablate:
        return chosen
    return [name for name in POLICIES if name in chosen or name in ABLATIONS]
