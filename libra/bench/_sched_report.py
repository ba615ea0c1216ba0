"""Printing and plotting a scheduling benchmark: the table, the JSON, the figure."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:  # _sched imports this module to print its reports
    from libra.bench._sched import SchedReport

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
