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
import math
import multiprocessing
import os
import sys
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import anyio
from trio.testing import MockClock

from libra import signals
from libra.bench._sched_fleet import (
    DEFAULT_FLEET,
    DEFAULT_MISMATCH,
    MISMATCH_PRESETS,
    FleetFile,
    load_fleet,
    with_mismatch,
)
from libra.bench._sched_report import plot, print_json, print_table
from libra.emulation import EmulatorApp, EmulatorConfig, create_app
from libra.emulation import FleetApp as FleetApp  # re-exported: its home until it moved
from libra.emulation.workloads import (
    EnvClasses,
    ScriptBook,
    ScriptTurn,
    TrajectoryScript,
    Workload,
    WorkloadError,
    WorkloadScript,
    load_workload,
    scripted_result,
)
from libra.engine import (
    ASGITransport,
    Engine,
    EngineConfig,
    SamplingConfig,
    TrajectoryJob,
    TrajectoryRecord,
    rollout,
)
from libra.envs import Task, ToolResult, ToolTimeout
from libra.fleet import StepCost
from libra.sched import RouteRequest, Scheduler
from libra.sched.policies import (
    ABLATIONS,
    CMLFQ,
    DEFAULT_POLICIES,
    POLICIES,
    CMLFQConfig,
    RoutedPolicy,
    Truth,
    make_policy,
)
from libra.signals import ToolSignal

MODEL = "libra-emulated"
_FOREVER_S = 1e7  # request, call and trajectory limits: a benchmark step never hits them
_CONTEXT_MARGIN = 4096  # template tokens beyond the workload's own context limit

Timeline = list[tuple[float, int]]  # (time, sequences running) at every change


@dataclass
class PolicyRun:
    """What one policy's step produced (before comparing policies)."""

    policy: str
    makespan_s: float
    trajectories: int
    failed: int
    output_tokens: int
    latencies_s: list[float]
    migrations: int  # calls that ran on another instance than the trajectory's last call
    bucket_moves: int  # of those, moves to another bucket
    gpu_busy_s: float  # sum over instances of TP x busy seconds
    gpus: int
    occupancy: dict[str, Timeline]  # per bucket
    reasons: dict[str, int] = field(default_factory=dict)
    preemptions: int = 0  # requests the servers preempted (KV ran short), all instances
    #: Per instance, the step cost the policy decided with at the end (a fitting policy's).
    fitted: dict[str, StepCost] = field(default_factory=dict)


@dataclass
class PolicyResult:
    policy: str
    throughput_traj_s: float
    throughput_tok_s: float
    makespan_s: float
    idle_frac: float
    p50_latency_s: float
    p99_latency_s: float
    tail_ratio: float
    migrations: int
    bucket_moves: int
    vs_oracle: float | None
    vs_bound: float
    vs_cmlfq: float | None  # the makespan over cmlfq's, when it ran (what an ablation costs)
    trajectories: int
    failed: int
    preemptions: int


@dataclass
class LowerBound:
    chain_s: float  # the longest trajectory alone on the fastest instance
    work_s: float  # all decode work at the fleet's full-batch throughput

    @property
    def seconds(self) -> float:
        return max(self.chain_s, self.work_s)


@dataclass
class SchedReport:
    workload: str
    fleet: str
    seed: int
    step: int
    trajectories: int
    lower_bound: LowerBound
    results: list[PolicyResult]
    runs: list[PolicyRun]
    mismatch: str = DEFAULT_MISMATCH

    def as_json(self) -> dict[str, Any]:
        return {
            "workload": self.workload,
            "fleet": self.fleet,
            "mismatch": self.mismatch,
            "seed": self.seed,
            "step": self.step,
            "trajectories": self.trajectories,
            "lower_bound_s": round(self.lower_bound.seconds, 3),
            "lower_bound": {
                "chain_s": round(self.lower_bound.chain_s, 3),
                "work_s": round(self.lower_bound.work_s, 3),
            },
            "results": [_rounded(vars(result)) for result in self.results],
        }


def _rounded(values: dict[str, Any]) -> dict[str, Any]:
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in values.items()}


# ------------------------------------------------------------------------ one policy


def run_policy(
    workload: Workload,
    fleet: FleetFile,
    policy: str,
    seed: int = 0,
    config: CMLFQConfig | None = None,
) -> PolicyRun:
    """One RL step of ``workload`` under ``policy`` (``config`` tunes ``cmlfq``), in
    virtual time; deterministic for a seed."""
    _seed_trio_scheduler(seed)
    clock = MockClock(autojump_threshold=0)
    result: PolicyRun = anyio.run(
        _run_policy,
        workload,
        fleet,
        policy,
        seed,
        config,
        backend="trio",
        backend_options={"clock": clock},
    )
    return result


def _seed_trio_scheduler(seed: int) -> None:
    """Trio breaks ties between tasks ready at the same instant with an unseeded RNG
    (to shake out order dependencies); seed it so that a run repeats exactly."""
    from trio._core import _run  # trio offers no public switch for this

    _run._r.seed(seed)


async def _run_policy(
    workload: Workload, fleet: FleetFile, name: str, seed: int, config: CMLFQConfig | None
) -> PolicyRun:
    book = ScriptBook(workload, seed)
    step = workload.rollout.history_steps
    scripts = book.step(step)
    spec = fleet.spec(MODEL)
    truth = truth_of(scripts, workload.limits.tool_timeout_s)
    policy = make_policy(name, spec, truth=truth, config=config)
    replay_history(policy, book, step)
    apps, timelines = _fleet_apps(workload, fleet, book, seed)
    env_classes = EnvClasses(book)
    jobs = [
        TrajectoryJob(env_classes(step, s.sample), Task(s.task_id, s.task_seed), s.sample, step)
        for s in scripts
    ]
    records: list[TrajectoryRecord] = []
    async with ASGITransport(FleetApp(apps)) as http:
        engine = Engine(http, policy, config=_engine_config(workload, len(jobs), seed))
        started = anyio.current_time()
        await rollout(jobs, engine, on_record=records.append)
        makespan = anyio.current_time() - started
    return _summarise(name, policy, fleet, apps, timelines, records, makespan)


def truth_of(scripts: list[TrajectoryScript], tool_timeout_s: float) -> Truth:
    """What the oracles are fed: every turn's output and its tool's seconds, by the
    scheduler's key (the engine's rendered trajectory id)."""
    return Truth(
        {
            str(script.trajectory_id): [
                (turn.output_tokens, _tool_s(turn, tool_timeout_s)) for turn in script.turns
            ]
            for script in scripts
        }
    )


def _tool_s(turn: ScriptTurn, tool_timeout_s: float) -> float:
    if turn.tool is None:
        return 0.0
    return tool_timeout_s if turn.status == "timeout" else turn.latency_s


def _engine_config(workload: Workload, concurrency: int, seed: int) -> EngineConfig:
    limits = workload.limits
    return EngineConfig(
        concurrency=concurrency,
        max_turns=limits.max_turns,
        max_context_tokens=limits.max_context_tokens + _CONTEXT_MARGIN,
        max_wall_s=_FOREVER_S,
        tool_timeout_s=limits.tool_timeout_s,
        request_timeout_s=_FOREVER_S,
        call_timeout_s=_FOREVER_S,  # a call queued behind a long batch is not a hang here
        stall_warning_s=_FOREVER_S,
        sampling=SamplingConfig(max_tokens_per_turn=limits.max_context_tokens, seed=seed),
    )


def _fleet_apps(
    workload: Workload, fleet: FleetFile, book: ScriptBook, seed: int
) -> tuple[dict[str, EmulatorApp], dict[str, Timeline]]:
    """One emulated server per instance, each recording its occupancy."""
    script = WorkloadScript(book)
    apps: dict[str, EmulatorApp] = {}
    timelines: dict[str, Timeline] = {}
    for plan in fleet.instances:
        config = EmulatorConfig(
            model_name=MODEL,
            latency=fleet.latency(plan.tp),
            prefix_caching=fleet.serving.prefix_caching,
            max_model_len=workload.limits.max_context_tokens + 2 * _CONTEXT_MARGIN,
            seed=seed,
        )
        app = apps[plan.name] = create_app(config, script)
        timeline = timelines[plan.name] = [(0.0, 0)]
        assert app.engine is not None  # a fleet's latency model is never zero
        app.engine.observer = _recorder(timeline)
    return apps, timelines


def _recorder(timeline: Timeline) -> Callable[[float, int, int], None]:
    def record(now: float, running: int, waiting: int) -> None:
        if running != timeline[-1][1]:
            timeline.append((now, running))

    return record


# -------------------------------------------------------------------------- history


def replay_history(policy: Scheduler, book: ScriptBook, step: int) -> None:
    """Show ``policy`` the earlier steps' trajectories through the protocol, one at a
    time (what a running system would have seen), then clear its decision log."""
    if isinstance(policy, RoutedPolicy) and policy.needs_truth:
        return  # it knows the truth and learns nothing
    first = max(0, step - book.workload.rollout.history_steps)
    for earlier in range(first, step):
        for script in book.step(earlier):
            _replay(policy, script, book.workload.limits.tool_timeout_s)
    if isinstance(policy, RoutedPolicy):
        policy.decisions.clear()
        policy.reasons.clear()


def _replay(policy: Scheduler, script: TrajectoryScript, timeout_s: float) -> None:
    generated, context, previous = 0, script.prompt_tokens, None
    trajectory, prompt = str(script.trajectory_id), str(script.task_id)  # as the engine's
    for index, turn in enumerate(script.turns):
        request = RouteRequest(
            trajectory,
            prompt,
            index,
            context,
            previous,
            generated_tokens=generated,
            env=script.workload,
        )
        route = policy.route(request)
        policy.release(route, outcome="ok", new_tokens=turn.output_tokens)
        previous = route.endpoint
        generated += turn.output_tokens
        context += turn.output_tokens
        if turn.tool is not None:
            policy.on_tool_return(trajectory, signal_of(turn, timeout_s))
            context += turn.output_chars
    policy.on_finish(trajectory, prompt, output_tokens=generated)


def signal_of(turn: ScriptTurn, timeout_s: float) -> ToolSignal:
    """The signal the engine derives from a scripted tool return: the same reduction of
    the same result (the workload env's, or the engine's own when it cuts a timeout)."""
    assert turn.tool is not None, "the final answer calls no tool"
    if turn.status == "timeout":
        result = ToolResult.of_error(ToolTimeout.after(turn.tool, timeout_s))
    else:
        result = scripted_result(turn)
    return signals.signal_of(turn.tool, result.content, result.status)


# -------------------------------------------------------------------------- metrics


def _summarise(
    name: str,
    policy: Scheduler,
    fleet: FleetFile,
    apps: dict[str, EmulatorApp],
    timelines: dict[str, Timeline],
    records: list[TrajectoryRecord],
    makespan: float,
) -> PolicyRun:
    plans = fleet.instances
    busy = 0.0
    preemptions = 0
    for plan in plans:
        engine = apps[plan.name].engine
        busy += plan.tp * (engine.busy_s if engine is not None else 0.0)
        preemptions += engine.num_preemptions if engine is not None else 0
    bucket_of = {plan.name: plan.bucket for plan in plans}
    migrations = bucket_moves = 0
    for record in records:
        for before, after in zip(record.endpoints, record.endpoints[1:], strict=False):
            if before != after:
                migrations += 1
                bucket_moves += bucket_of[before] != bucket_of[after]
    occupancy = _bucket_occupancy(timelines, bucket_of, [b.name for b in fleet.bucket])
    reasons = dict(policy.reasons) if isinstance(policy, RoutedPolicy) else {}
    fitted = {}
    if isinstance(policy, CMLFQ) and policy.fit is not None:
        fitted = {i.name: policy.fit.cost(i) for i in policy.router.instances}
    return PolicyRun(
        policy=name,
        makespan_s=makespan,
        trajectories=len(records),
        failed=sum(record.status == "failed" for record in records),
        output_tokens=sum(sum(record.loss_mask) for record in records),
        latencies_s=sorted(record.timings.total_s for record in records),
        migrations=migrations,
        bucket_moves=bucket_moves,
        gpu_busy_s=busy,
        gpus=fleet.gpus,
        occupancy=occupancy,
        reasons=reasons,
        preemptions=preemptions,
        fitted=fitted,
    )


def _bucket_occupancy(
    timelines: dict[str, Timeline], bucket_of: dict[str, str], buckets: list[str]
) -> dict[str, Timeline]:
    """Sequences running in each bucket over time (sum of its instances' timelines)."""
    result: dict[str, Timeline] = {}
    for bucket in buckets:
        changes: list[tuple[float, int]] = []
        for name, timeline in timelines.items():
            if bucket_of[name] != bucket:
                continue
            level = 0
            for moment, running in timeline:
                changes.append((moment, running - level))
                level = running
        changes.sort()
        total, merged = 0, [(0.0, 0)]
        for moment, delta in changes:
            total += delta
            if moment == merged[-1][0]:
                merged[-1] = (moment, total)
            else:
                merged.append((moment, total))
        result[bucket] = merged
    return result


def _quantile(ordered: list[float], q: float) -> float:
    if not ordered:
        return 0.0
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def lower_bound(
    scripts: list[TrajectoryScript], fleet: FleetFile, tool_timeout_s: float
) -> LowerBound:
    """See the module docstring. Template tokens are left out, which only lowers it."""
    tps = sorted({plan.tp for plan in fleet.instances})
    demand = decode_demand(scripts, fleet)
    throughput = sum(full_batch_throughput(fleet, plan.tp, demand) for plan in fleet.instances)
    return LowerBound(
        chain_s=longest_alone_s(scripts, fleet, tps, tool_timeout_s),
        work_s=demand.tokens / throughput,
    )


@dataclass(frozen=True)
class DecodeDemand:
    """A step's decode work: tokens sampled, the mean context they are sampled at, and
    the mean KV a call holds."""

    tokens: float
    mean_context: float
    mean_reservation: float


def decode_demand(scripts: list[TrajectoryScript], fleet: FleetFile) -> DecodeDemand:
    decode_tokens = weighted_context = 0.0
    reservations = 0.0
    # KV a call holds on average: its whole reply when reserved up front, half of it when
    # taken a token at a time (vLLM's on-demand allocation).
    held = 0.5 if fleet.serving.kv_allocation == "on_demand" else 1.0
    calls = 0
    for script in scripts:
        context = float(script.prompt_tokens)
        for turn in script.turns:
            decode_tokens += turn.output_tokens
            weighted_context += turn.output_tokens * (context + turn.output_tokens / 2)
            reservations += context + turn.output_tokens * held
            calls += 1
            context += turn.output_tokens + turn.output_chars
    return DecodeDemand(
        decode_tokens,
        weighted_context / max(decode_tokens, 1.0),
        reservations / max(calls, 1),
    )


def longest_alone_s(
    scripts: list[TrajectoryScript], fleet: FleetFile, tps: list[int], tool_timeout_s: float
) -> float:
    """The slowest trajectory, each run alone on its fastest instance size of ``tps``."""
    return max(min(_alone(s, fleet, tp, tool_timeout_s) for tp in tps) for s in scripts)


def _alone(script: TrajectoryScript, fleet: FleetFile, tp: int, tool_timeout_s: float) -> float:
    cost = fleet.latency(tp)  # what the servers really play
    seconds, context, fresh = 0.0, float(script.prompt_tokens), float(script.prompt_tokens)
    for turn in script.turns:
        n = turn.output_tokens
        seconds += cost.prefill_time(fresh)
        first = cost.step_time(1, context)
        seconds += n * first + cost.step_per_ctx_token_s * n * (n - 1) / 2
        seconds += _tool_s(turn, tool_timeout_s)
        context += n + turn.output_chars
        fresh = turn.output_chars
    return seconds


def full_batch_throughput(fleet: FleetFile, tp: int, demand: DecodeDemand) -> float:
    """Tokens/s of a TP``tp`` instance running as many sequences as fit."""
    cost = fleet.latency(tp)
    fits = int(cost.kv_capacity_tokens // max(demand.mean_reservation, 1.0))
    batch = max(1, min(fleet.serving.max_num_seqs, fits))
    return batch / cost.step_time(batch, batch * demand.mean_context)


# ------------------------------------------------------------------------ all of them


def run_sched_bench(
    workload: Workload,
    fleet: FleetFile,
    policies: list[str],
    *,
    seed: int = 0,
    fleet_name: str = "",
    jobs: int = 1,
    mismatch: str = DEFAULT_MISMATCH,
) -> SchedReport:
    """Every policy on the same step; ``jobs`` > 1 runs policies in parallel processes
    (each run is deterministic on its own, so the numbers do not change)."""
    if jobs > 1 and len(policies) > 1:
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(min(jobs, len(policies)), mp_context=context) as pool:
            futures = [pool.submit(run_policy, workload, fleet, p, seed) for p in policies]
            runs = [future.result() for future in futures]
    else:
        runs = [run_policy(workload, fleet, policy, seed) for policy in policies]
    step = workload.rollout.history_steps
    scripts = ScriptBook(workload, seed).step(step)
    bound = lower_bound(scripts, fleet, workload.limits.tool_timeout_s)
    oracle = next((run.makespan_s for run in runs if run.policy == "oracle"), None)
    cmlfq = next((run.makespan_s for run in runs if run.policy == "cmlfq"), None)
    return SchedReport(
        workload=workload.name,
        fleet=fleet_name or fleet.name,
        seed=seed,
        step=step,
        trajectories=len(scripts),
        lower_bound=bound,
        results=[_result(run, bound, oracle, cmlfq) for run in runs],
        runs=runs,
        mismatch=mismatch,
    )


def _result(
    run: PolicyRun, bound: LowerBound, oracle: float | None, cmlfq: float | None
) -> PolicyResult:
    makespan = run.makespan_s
    p50 = _quantile(run.latencies_s, 0.5)
    p99 = _quantile(run.latencies_s, 0.99)
    idle = 1.0 - run.gpu_busy_s / (run.gpus * makespan) if makespan > 0 else 0.0
    return PolicyResult(
        policy=run.policy,
        throughput_traj_s=run.trajectories / makespan if makespan else 0.0,
        throughput_tok_s=run.output_tokens / makespan if makespan else 0.0,
        makespan_s=makespan,
        idle_frac=idle,
        p50_latency_s=p50,
        p99_latency_s=p99,
        tail_ratio=p99 / p50 if p50 else 0.0,
        migrations=run.migrations,
        bucket_moves=run.bucket_moves,
        vs_oracle=makespan / oracle if oracle else None,
        vs_bound=makespan / bound.seconds if bound.seconds else 0.0,
        vs_cmlfq=makespan / cmlfq if cmlfq else None,
        trajectories=run.trajectories,
        failed=run.failed,
        preemptions=run.preemptions,
    )


def default_jobs() -> int:
    return max(1, min(4, os.cpu_count() or 1))


# ------------------------------------------------------------------- the command line

DEFAULT_WORKLOAD = "swe-agent"


def main_sched(args: argparse.Namespace) -> int:
    """``libra bench sched``: run, then print the table (or JSON) and draw the plot."""
    try:
        workload = load_workload(args.workload)
        fleet = with_mismatch(load_fleet(args.fleet), args.mismatch)
        policies = parse_policies(args.policies, ablate=args.ablate)
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
    )
    if args.json:
        print_json(report)
    else:
        print_table(report)
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--workload",
        default=DEFAULT_WORKLOAD,
        help=f"a shipped workload or a workload TOML file (default {DEFAULT_WORKLOAD})",
    )
    parser.add_argument(
        "--policies",
        default="",
        help=f"comma-separated, from {', '.join(POLICIES)} (default: all but the "
        "ablations and the oracles other than oracle)",
    )
    parser.add_argument(
        "--fleet",
        default=DEFAULT_FLEET,
        help=f"a shipped fleet or a fleet TOML file (default {DEFAULT_FLEET})",
    )
    presets = "; ".join(f"{name}: {text}" for name, text in MISMATCH_PRESETS.items())
    presets = presets.replace("%", "%%")  # argparse formats help strings with %
    parser.add_argument(
        "--mismatch",
        default=DEFAULT_MISMATCH,
        choices=list(MISMATCH_PRESETS),
        metavar="PRESET",
        help="how the emulated servers really perform while the scheduler keeps the "
        f"datasheet roofline as its cost model ({presets}; default {DEFAULT_MISMATCH})",
    )
    ablations = "; ".join(f"{name}: without {what}" for name, what in ABLATIONS.items())
    parser.add_argument(
        "--ablate",
        action="store_true",
        help=f"add C-MLFQ with one mechanism taken out ({ablations})",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the run (default 0)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--plot", metavar="FILE.png", help="draw occupancy and makespans")
    parser.add_argument(
        "--jobs",
        type=int,
        default=default_jobs(),
        help="policies run in parallel processes; the numbers do not change "
        f"(default {default_jobs()}: the CPUs, up to 4)",
    )
