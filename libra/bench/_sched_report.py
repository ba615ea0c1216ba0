"""A scheduling benchmark's report: what each policy's step produced and how it compares
(the types), and how it is shown (the table, the JSON, the figure)."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from libra.bench._sched_fleet import DEFAULT_MISMATCH
from libra.fleet import StepCost

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
    guess: Guess | None = None  # how far its estimates were from the truth, if it estimates
    straggler: Straggler | None = None  # the trajectory that finished last


@dataclass(frozen=True)
class Call:
    """One routing decision of the straggler: when, which turn, where to and why, the
    remaining output the policy expected (None: it does not estimate) and the truth; the
    upper quantile of its guess is what the ``finish`` rule prices a straggler by."""

    at_s: float
    turn: int
    instance: str
    reason: str
    expected: float | None
    true_left: int
    expected_upper: float | None = None


@dataclass(frozen=True)
class Straggler:
    """The trajectory that finished last, which decides the makespan: its seconds, in
    generation and in tools, its output, and the policy's decisions on its calls (those
    still in the policy's decision log)."""

    id: str
    seconds: float
    generation_s: float
    tool_s: float
    output_tokens: int
    calls: list[Call]


@dataclass(frozen=True)
class Guess:
    """What a policy that estimates guessed against what the oracle knows, over its
    logged routing decisions: the remaining output it expected over the true remaining
    (the median; and the share of calls off by more than 2x either way), and the tool
    seconds still to come, which it does not estimate (their mean)."""

    calls: int
    tokens_ratio_median: float
    tokens_off_2x: float
    tool_s_unseen: float


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
    guess_ratio_median: float | None = None  # see Guess
    guess_off_2x: float | None = None
    tool_s_unseen: float | None = None


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
    trace: bool = False  # the JSON tells each policy's straggler
    cmlfq_settings: tuple[str, ...] = ()  # how cmlfq was tuned (KEY=VALUE), if it was

    def as_json(self) -> dict[str, Any]:
        stragglers = {run.policy: asdict(run.straggler) for run in self.runs if run.straggler}
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
            **({"cmlfq_settings": list(self.cmlfq_settings)} if self.cmlfq_settings else {}),
            **({"stragglers": stragglers} if self.trace else {}),
        }


def _rounded(values: dict[str, Any]) -> dict[str, Any]:
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in values.items()}


_COLUMNS = (
    "policy",
    "traj/s",
    "tok/s",
    "makespan s",
    "GPU idle",
    "p99/p50",
    "migrations",
    "preempted",
    "x oracle",
    "x bound",
    "x cmlfq",
)


def title(report: SchedReport) -> str:
    bound = report.lower_bound
    return (
        f"libra bench sched: {report.workload} on {report.fleet} "
        f"(mismatch {report.mismatch}), "
        f"{report.trajectories} trajectories, seed {report.seed}; lower bound "
        f"{bound.seconds:.1f} s (longest alone {bound.chain_s:.1f} s, "
        f"work at full batch {bound.work_s:.1f} s)"
    )


def print_table(report: SchedReport, console: Console | None = None) -> None:
    table = Table(title=title(report))
    for column in _COLUMNS:
        table.add_column(column, justify="left" if column == "policy" else "right")
    for r in report.results:
        vs_oracle = f"{r.vs_oracle:.2f}" if r.vs_oracle is not None else "-"
        vs_cmlfq = f"{r.vs_cmlfq:.3f}" if r.vs_cmlfq is not None else "-"
        failed = f" ({r.failed} failed)" if r.failed else ""
        table.add_row(
            r.policy + failed, f"{r.throughput_traj_s:.3f}", f"{r.throughput_tok_s:,.0f}",
            f"{r.makespan_s:.1f}", f"{r.idle_frac:.2f}", f"{r.tail_ratio:.2f}",
            f"{r.migrations}", f"{r.preemptions}", vs_oracle, f"{r.vs_bound:.2f}", vs_cmlfq,
        )  # fmt: skip
    if console is None:  # rich narrows to 80 columns when not on a terminal: too few
        console = Console(width=None if sys.stdout.isatty() else 132)
    console.print(table)


def print_stragglers(report: SchedReport, console: Console | None = None) -> None:
    """Each policy's last trajectory, call by call."""
    console = console or Console(width=None if sys.stdout.isatty() else 132)
    for run in report.runs:
        s = run.straggler
        if s is None:
            continue
        console.print(
            f"{run.policy}: last {s.id}, {s.seconds:.1f} s ({s.generation_s:.1f} s generating, "
            f"{s.tool_s:.1f} s in tools), {s.output_tokens} tokens"
        )
        for c in s.calls:
            guess = f"expected {c.expected:.0f}" if c.expected is not None else "no estimate"
            if c.expected_upper is not None and c.expected_upper != c.expected:
                guess += f" (upper {c.expected_upper:.0f})"
            console.print(
                f"  {c.at_s:7.1f} s  turn {c.turn:2}  {c.instance:<12} {c.reason:<24} "
                f"{guess}, {c.true_left} left"
            )


def print_json(report: SchedReport) -> None:
    print(json.dumps(report.as_json()))


def plot(report: SchedReport, path: str | Path) -> None:
    """Per-bucket occupancy over time for each policy, and the makespans side by side."""
    import matplotlib

    matplotlib.use("Agg")  # no display: write the file only
    import matplotlib.pyplot as plt

    runs = report.runs
    columns = 4
    rows = -(-(len(runs) + 1) // columns)
    figure, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 2.8 * rows), squeeze=False)
    flat = [axis for row in axes for axis in row]
    longest = max(run.makespan_s for run in runs)
    for axis, run in zip(flat, runs, strict=False):
        for bucket, timeline in run.occupancy.items():
            times = [moment for moment, _ in timeline] + [run.makespan_s]
            counts = [count for _, count in timeline] + [timeline[-1][1]]
            axis.step(times, counts, where="post", label=bucket, linewidth=1.0)
        axis.set_title(f"{run.policy}: {run.makespan_s:.0f} s", fontsize=9)
        axis.set_xlim(0, longest)
        axis.set_xlabel("virtual time (s)", fontsize=7)
        axis.set_ylabel("sequences running", fontsize=7)
        axis.tick_params(labelsize=7)
    flat[0].legend(fontsize=7, title="bucket", title_fontsize=7)
    bars = flat[len(runs)]
    names = [run.policy for run in runs]
    bars.barh(names, [run.makespan_s for run in runs], color="tab:blue")
    bars.axvline(report.lower_bound.seconds, color="black", linestyle="--", label="lower bound")
    bars.invert_yaxis()
    bars.set_title("makespan (s)", fontsize=9)
    bars.tick_params(labelsize=7)
    bars.legend(fontsize=7)
    for axis in flat[len(runs) + 1 :]:
        axis.axis("off")
    figure.suptitle(title(report), fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
