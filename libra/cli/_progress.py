"""Live progress of a rollout: a bar with counters, and the summary printed at the end."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)

from libra.launch import RolloutStats


def counters(stats: RolloutStats) -> str:
    reward = stats.reward_mean
    return (
        f"[green]{stats.statuses['completed']} completed[/] "
        f"[yellow]{stats.statuses['truncated']} truncated[/] "
        f"[red]{stats.statuses['failed']} failed[/] · "
        f"reward {'-' if reward is None else f'{reward:.3f}'} · "
        f"{stats.trajectories_per_s:.1f} traj/s"
    )


@contextmanager
def rollout_progress(stats: RolloutStats, *, enabled: bool = True) -> Iterator[Callable[[], None]]:
    """Yields a function to call after each record; draws nothing when not ``enabled``."""
    console = Console(stderr=True)
    progress = Progress(
        TextColumn("[bold]rollout"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[counters]}"),
        console=console,
        disable=not enabled,
    )
    task = progress.add_task("rollout", total=stats.total, counters="")
    with progress:
        yield lambda: progress.update(task, completed=stats.done, counters=counters(stats))


def summary(stats: RolloutStats) -> str:
    statuses = ", ".join(f"{stats.statuses[s]} {s}" for s in ("completed", "truncated", "failed"))
    reward = stats.reward_mean
    per = stats.turns / stats.done if stats.done else 0.0
    return (
        f"{stats.done} trajectories in {stats.elapsed_s:.1f} s "
        f"({stats.trajectories_per_s:.1f} trajectories/s): {statuses}\n"
        f"reward mean {'n/a' if reward is None else f'{reward:.3f}'} · {per:.1f} turns/trajectory"
        f" · {stats.sampled_tokens} sampled tokens\n"
        f"{stats.tool_calls} tool calls ({stats.tool_successes} succeeded)"
        f" in {stats.with_tool_calls} of {stats.done} trajectories"
    )
