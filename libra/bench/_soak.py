"""``libra bench soak``: many emulated trajectories under random faults, counted.

The real engine and C-MLFQ router run trajectories of a small agentic workload against an
in-process fleet of emulated vLLM servers (``FleetApp``) on trio's virtual clock, so a
hundred thousand multi-turn trajectories take minutes. The servers inject faults at
``fault_rate`` per generation request: stalls (no answer until the client gives up), HTTP
500s, aborts (a partial reply), garbage bodies, and deaths; a dead instance is taken out of
the router's live membership and a fresh one joins under its name after a while. The
workload's own check tool hangs now and then, so tool timeouts are in the mix too.

Jobs are made as admission takes them (never all up front) and records are counted, not
kept: what stays in memory is what is in flight. Reported: each outcome
(``status/stop_reason``), trajectories lost (submitted, never recorded) and duplicated
(recorded twice), restarts, and the process's RSS and threads at the start and the end.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.abc

from libra.bench._emulated_fleet import MODEL, in_virtual_time
from libra.bench._sched_fleet import DEFAULT_FLEET, FleetFile, load_fleet
from libra.emulation import EmulatorApp, EmulatorConfig, FleetApp, create_app
from libra.emulation.workloads import EnvClasses, ScriptBook, Workload, WorkloadScript
from libra.engine import (
    ASGITransport,
    Engine,
    EngineConfig,
    RolloutSession,
    SamplingConfig,
    TrajectoryJob,
)
from libra.envs import Task
from libra.sched.policies import RoutedPolicy, make_policy

DEFAULT_N = 100_000
DEFAULT_FAULT_RATE = 0.02
# A death is rarer than the other faults: each one costs an instance for RESTART_S.
DEATH_SHARE = 0.02
NOTICE_S = 5.0  # from a death until the supervisor takes the instance out of the router
RESTART_S = 60.0  # from then until a fresh server joins under the same name
PROGRESS_EVERY = 0.1  # of n
_CONTEXT = 8192


def soak_workload() -> Workload:
    """Short tool-using trajectories (about a hundred tokens a turn, 1-6 turns), with a
    check tool that hangs past its timeout now and then: cheap to emulate by the 100,000."""
    return Workload.model_validate(
        {
            "name": "soak",
            "description": "short agentic trajectories for the fault soak",
            "rollout": {"prompts": 16, "samples_per_prompt": 8, "history_steps": 0},
            "limits": {"max_turns": 6, "max_context_tokens": 4096, "tool_timeout_s": 10.0},
            "prompt_tokens": {"median": 80, "sigma": 0.4, "min": 20, "max": 400},
            "solve_rate": {"alpha": 1.0, "beta": 1.0, "give_up": 0.2},
            "turn": {
                "tokens": {"median": 120, "sigma": 0.4, "min": 96, "max": 400},
                "final_tokens": {"median": 30, "sigma": 0.4, "min": 8, "max": 120},
            },
            "explore": [
                {
                    "name": "search",
                    "calls_first_attempt": [0, 2],
                    "calls_later_attempts": [0, 1],
                    "latency_s": {"median": 0.5, "sigma": 0.5},
                    "output": {"chars": {"median": 200, "sigma": 0.5, "max": 1000}},
                }
            ],
            "check": {
                "name": "check",
                "latency_s": {"median": 1.0, "sigma": 0.4},
                "on_pass": {"chars": {"median": 40}},
                "on_fail": {"status": "failure", "chars": {"median": 200, "sigma": 0.4}},
                "timeout_probability": 0.05,
            },
        }
    )


# ------------------------------------------------------------------------ the counts


@dataclass
class SoakReport:
    trajectories: int
    outcomes: Counter[str]
    lost: int
    duplicated: int
    restarts: int
    restarted_serving: int  # restarted servers that then generated tokens
    leftovers: dict[str, int]  # state the engine and scheduler still hold at the end
    rss_start_mb: float
    rss_end_mb: float
    threads_start: int
    threads_end: int
    wall_s: float
    virtual_s: float
    fault_rate: float
    rss_marks_mb: list[float]  # at every tenth of the trajectories recorded

    def as_json(self) -> dict[str, Any]:
        return {
            "trajectories": self.trajectories,
            "outcomes": dict(sorted(self.outcomes.items())),
            "lost": self.lost,
            "duplicated": self.duplicated,
            "rss_start_mb": round(self.rss_start_mb, 1),
            "rss_end_mb": round(self.rss_end_mb, 1),
            "rss_mb_at_each_tenth": [round(mb) for mb in self.rss_marks_mb],
            "threads": {"start": self.threads_start, "end": self.threads_end},
            "restarts": self.restarts,
            "restarted_serving": self.restarted_serving,
            "leftovers": self.leftovers,
            "fault_rate": self.fault_rate,
            "wall_s": round(self.wall_s, 1),
            "virtual_s": round(self.virtual_s, 1),
        }


@dataclass
class _Tally:
    """Records counted against the ids submitted and not yet recorded."""

    outstanding: set[str] = field(default_factory=set)
    outcomes: Counter[str] = field(default_factory=Counter)
    recorded: int = 0
    duplicated: int = 0

    def submitted(self, job: TrajectoryJob) -> None:
        self.outstanding.add(str(job.id))

    def record(self, trajectory_id: str, status: str, stop_reason: str) -> None:
        self.recorded += 1
        if trajectory_id in self.outstanding:
            self.outstanding.remove(trajectory_id)
            self.outcomes[f"{status}/{stop_reason}"] += 1
        else:  # recorded before (ids are unique to a job): a second record
            self.duplicated += 1


def rss_mb() -> float:
    """The process's resident memory now (not the peak ``resource`` reports)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource  # no /proc (macOS): the peak is the best there is

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 / 1024


# ------------------------------------------------------------------------- the run


Progress = Callable[[int, int, float], None]


def run_soak(
    n: int = DEFAULT_N,
    fault_rate: float = DEFAULT_FAULT_RATE,
    *,
    seed: int = 0,
    fleet_name: str = DEFAULT_FLEET,
    progress: Progress | None = None,
) -> SoakReport:
    """Run ``n`` trajectories under faults at ``fault_rate`` (see the module)."""
    if not 0 <= fault_rate <= 1:
        raise ValueError(f"the fault rate must be in [0, 1], not {fault_rate}")
    fleet = load_fleet(fleet_name)
    gc.collect()
    rss_start, threads_start = rss_mb(), threading.active_count()
    started = time.perf_counter()
    soak = _Soak(n, fault_rate, seed, fleet, progress)
    virtual_s = in_virtual_time(soak.run, seed=seed)
    wall = time.perf_counter() - started
    tally, restarts, leftovers, marks = soak.tally, soak.restarts, soak.leftovers, soak.rss_marks_mb
    restarted_serving = soak.restarted_serving + sum(
        soak.served(name) for name in soak.fleet_app.apps if name in soak.restarted
    )
    lost = len(tally.outstanding)
    del soak
    gc.collect()
    return SoakReport(
        trajectories=tally.recorded,
        outcomes=tally.outcomes,
        lost=lost,
        duplicated=tally.duplicated,
        restarts=restarts,
        restarted_serving=restarted_serving,
        leftovers=leftovers,
        rss_start_mb=rss_start,
        rss_end_mb=rss_mb(),
        threads_start=threads_start,
        threads_end=threading.active_count(),
        wall_s=wall,
        virtual_s=virtual_s,
        fault_rate=fault_rate,
        rss_marks_mb=marks,
    )


class _Soak:
    """One soak: the fleet, its supervisor, the feeder and the counter."""

    def __init__(
        self, n: int, fault_rate: float, seed: int, fleet: FleetFile, progress: Progress | None
    ) -> None:
        self.n, self.fault_rate, self.seed, self.fleet = n, fault_rate, seed, fleet
        self.progress = progress
        self.workload = soak_workload()
        self.book = ScriptBook(self.workload, seed, max_cached=4096)
        self.env_classes = EnvClasses(self.book)
        self.tally = _Tally()
        self.rss_marks_mb: list[float] = []
        self.restarts = 0
        self.restarted: set[str] = set()  # instances whose server a restart started
        self.restarted_serving = 0  # such servers that generated tokens, once gone
        self.specs = {spec.name: spec for spec in fleet.spec(MODEL).instances}
        self.bucket_of = {plan.name: plan.bucket for plan in fleet.instances}
        self.fleet_app = FleetApp()  # the instances serving now, by name
        self.policy: RoutedPolicy = make_policy("cmlfq", fleet.spec(MODEL))
        self._group: anyio.abc.TaskGroup | None = None
        self._groups = self._jobs()
        self.leftovers: dict[str, int] = {}
        self._fed_all = False

    async def run(self) -> float:
        started = anyio.current_time()
        async with anyio.create_task_group() as group:
            self._group = group
            for name in self.specs:
                self.fleet_app.add(name, self._server(name))
            await self._roll(self.fleet_app)
            group.cancel_scope.cancel()  # restarts still pending: the run is over
        return anyio.current_time() - started

    async def _roll(self, fleet_app: FleetApp) -> None:
        async with ASGITransport(fleet_app) as http:
            engine = Engine(http, self.policy, config=self._engine_config())
            async with RolloutSession(engine) as session:
                self._top_up(session)
                await self._read(session)
        self.leftovers = self._leftovers(engine)

    def _leftovers(self, engine: Engine) -> dict[str, int]:
        """What the engine and scheduler still hold once every record is out: all zero,
        or something leaks a trajectory's state."""
        router = self.policy.router
        return {
            "live_ids": len(engine.live_ids),
            "tracks": len(self.policy.tracks),
            "homes": len(router.home),
            "calls_in_flight": sum(i.in_flight for i in router.instances),
        }

    def _engine_config(self) -> EngineConfig:
        limits = self.workload.limits
        return EngineConfig(
            concurrency=256,
            max_turns=limits.max_turns,
            max_context_tokens=_CONTEXT,
            max_wall_s=3600.0,
            tool_timeout_s=limits.tool_timeout_s,
            request_timeout_s=600.0,
            call_timeout_s=60.0,
            call_timeout_per_token_s=0.05,
            stall_warning_s=1e7,  # a virtual-time run: the warning would only be noise
            capacity_wait_s=600.0,
            sampling=SamplingConfig(max_tokens_per_turn=512, seed=self.seed),
        )

    # ------------------------------------------------------------------ feeding

    def _jobs(self) -> Iterator[list[TrajectoryJob]]:
        """Groups of jobs, ``n`` in all, each of a task of its own: task seeds count up, so
        every id is unique without keeping them. All at step 0: one env class per sample
        (a class per step would grow with the run, and the soak measures what grows)."""
        samples = self.workload.rollout.samples_per_prompt
        for first in range(0, self.n, samples):
            task = Task.from_seed(self.workload.name, first // samples)
            yield [
                TrajectoryJob(self.env_classes(0, sample), task, sample, 0)
                for sample in range(min(samples, self.n - first))
            ]

    def _top_up(self, session: RolloutSession) -> None:
        """Keep a few groups queued ahead of admission, never more (called as records come
        out, so the queue refills as it drains); close the session after the last."""
        ahead = self.workload.rollout.samples_per_prompt * 4
        while not self._fed_all and session.queued < ahead:
            group = next(self._groups, None)
            if group is None:
                self._fed_all = True
                session.close()
                return
            for job in group:
                self.tally.submitted(job)
            session.submit(group)

    async def _read(self, session: RolloutSession) -> None:
        every = max(1, int(self.n * PROGRESS_EVERY))
        started = time.perf_counter()
        async for record in session.records():
            self.tally.record(record.id, record.status, record.stop_reason)
            self._top_up(session)
            if self.tally.recorded % every == 0:
                self.rss_marks_mb.append(rss_mb())
                if self.progress is not None:
                    self.progress(self.tally.recorded, self.n, time.perf_counter() - started)

    # ------------------------------------------------------------- the fleet

    def served(self, name: str) -> bool:
        """Whether ``name``'s current server generated tokens."""
        return self.fleet_app.apps[name].generation_tokens_total > 0

    def _server(self, name: str) -> EmulatorApp:
        """A fresh emulated server for instance ``name`` (its faults seeded anew)."""
        index, plan = next(
            (i, plan) for i, plan in enumerate(self.fleet.instances) if plan.name == name
        )
        rate = self.fault_rate
        death = rate * DEATH_SHARE
        share = (rate - death) / 4
        config = EmulatorConfig(
            model_name=MODEL,
            latency=self.fleet.latency(plan.tp),
            prefix_caching=self.fleet.serving.prefix_caching,
            max_model_len=_CONTEXT + 1024,
            # Each instance, and each restart of one, draws its own faults.
            seed=self.seed * 1_000_003 + self.restarts * 101 + index,
            error_rate=share,
            stall_rate=share,
            abort_rate=share,
            garbage_rate=share,
            die_rate=death,
        )
        app = create_app(config, WorkloadScript(self.book))
        app.faults.on_death = lambda: self._died(name)
        return app

    def _died(self, name: str) -> None:
        assert self._group is not None
        self._group.start_soon(self._restart, name)

    async def _restart(self, name: str) -> None:
        """What a supervisor does: notice the death, take the instance out of the live
        membership (its calls in flight fail and are retried elsewhere), stop the dead
        server, start a new one and let it join under the same name."""
        await anyio.sleep(NOTICE_S)
        router = self.policy.router
        if name in router.by_name:
            router.remove(name, force=True)
        if self.served(name) and name in self.restarted:
            self.restarted_serving += 1
        self.fleet_app.remove(name)
        await anyio.sleep(RESTART_S)
        self.restarts += 1
        self.restarted.add(name)
        self.fleet_app.add(name, self._server(name))
        router.add_instance(self.specs[name], self.bucket_of[name])


# ------------------------------------------------------------------- the command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--n", type=int, default=DEFAULT_N, help=f"trajectories (default {DEFAULT_N:,})"
    )
    parser.add_argument(
        "--fault-rate",
        type=float,
        default=DEFAULT_FAULT_RATE,
        help="faults per generation request: stalls, HTTP 500s, aborts and garbage in equal "
        f"shares, deaths {DEATH_SHARE:g} of it (default {DEFAULT_FAULT_RATE})",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the run (default 0)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a summary")


def main_soak(args: argparse.Namespace) -> int:
    def progress(done: int, n: int, wall_s: float) -> None:
        print(f"soak: {done:,}/{n:,} trajectories, {wall_s:.0f} s, {rss_mb():.0f} MB RSS",
              file=sys.stderr, flush=True)  # fmt: skip

    try:
        report = run_soak(args.n, args.fault_rate, seed=args.seed, progress=progress)
    except ValueError as exc:
        print(f"libra: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report.as_json()))
    else:
        _print_summary(report)
    clean = report.lost == report.duplicated == 0 and not any(report.leftovers.values())
    return 0 if clean else 1


def _print_summary(report: SoakReport) -> None:
    print(f"{report.trajectories:,} trajectories in {report.wall_s:.0f} s "
          f"({report.virtual_s:,.0f} s emulated), fault rate {report.fault_rate:g}, "
          f"{report.restarts} server restarts")  # fmt: skip
    for outcome, count in sorted(report.outcomes.items(), key=lambda item: -item[1]):
        print(f"  {outcome:<40} {count:>9,}")
    print(f"lost {report.lost}, duplicated {report.duplicated}; left behind: {report.leftovers}")
    print(f"RSS {report.rss_start_mb:.0f} MB -> {report.rss_end_mb:.0f} MB, "
          f"threads {report.threads_start} -> {report.threads_end}")  # fmt: skip
