"""A rollout's timeline: its progress sampled while it runs, and a plot of it.

Every ``interval_s`` the rollout's calls in flight on each endpoint (the scheduler's
count) and its finished trajectories are noted; ``libra rollout --plot FILE.png`` draws
them: how busy each server (or bucket) was over time, and how trajectories ended.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import anyio

from libra.launch import RolloutStats


class Routing(Protocol):
    """What a timeline reads of the scheduler: its calls in flight by endpoint."""

    def calls_in_flight(self) -> dict[str, int]: ...


_STATUSES = ("completed", "truncated", "failed")


@dataclass
class Timeline:
    seconds: list[float] = field(default_factory=list)
    calls_in_flight: dict[str, list[int]] = field(default_factory=dict)  # by endpoint
    ended: dict[str, list[int]] = field(default_factory=dict)  # by status, cumulative
    reward_mean: list[float | None] = field(default_factory=list)

    def sample(self, elapsed_s: float, scheduler: Routing, stats: RolloutStats) -> None:
        self.seconds.append(elapsed_s)
        now = scheduler.calls_in_flight()
        for endpoint in now.keys() - self.calls_in_flight.keys():
            # An endpoint first seen late (it joined the fleet) has had no calls before.
            self.calls_in_flight[endpoint] = [0] * (len(self.seconds) - 1)
        for endpoint, series in self.calls_in_flight.items():
            series.append(now.get(endpoint, 0))  # one that left the fleet has none
        for status in _STATUSES:
            self.ended.setdefault(status, []).append(stats.statuses[status])
        self.reward_mean.append(stats.reward_mean)


async def record_timeline(
    timeline: Timeline, scheduler: Routing, stats: RolloutStats, interval_s: float = 0.25
) -> None:
    """Sample until cancelled (run it beside the rollout)."""
    started = anyio.current_time()
    while True:
        timeline.sample(anyio.current_time() - started, scheduler, stats)
        await anyio.sleep(interval_s)


def plot_timeline(timeline: Timeline, path: Path, title: str, labels: dict[str, str]) -> None:
    """Calls in flight per endpoint (``labels`` names them) above trajectories ended."""
    import matplotlib

    matplotlib.use("Agg")  # no display: write the file only
    import matplotlib.pyplot as plt

    figure, (calls, ended) = plt.subplots(2, 1, figsize=(8, 5.5), sharex=True)
    # Each value holds until the next sample; the last one a little past the end, so the
    # final state shows.
    seconds = [*timeline.seconds, timeline.seconds[-1] * 1.01 + 0.1]

    def held(series: list[int]) -> list[int]:
        return [*series, series[-1]]

    for endpoint, series in timeline.calls_in_flight.items():
        calls.step(seconds, held(series), where="post", label=labels.get(endpoint, endpoint))
    calls.set_ylabel("generation calls in flight")
    calls.legend(fontsize=7, loc="upper right")
    colors = {"completed": "tab:green", "truncated": "tab:orange", "failed": "tab:red"}
    ended.stackplot(
        seconds,
        *(held(timeline.ended[status]) for status in _STATUSES),
        labels=_STATUSES,
        colors=[colors[status] for status in _STATUSES],
        step="post",
        alpha=0.8,
    )
    ended.set_ylabel("trajectories ended")
    ended.set_xlabel("seconds")
    ended.legend(fontsize=7, loc="upper left")
    samples = zip(timeline.seconds, timeline.reward_mean, strict=True)
    rewards = [(second, mean) for second, mean in samples if mean is not None]
    if rewards:
        reward = ended.twinx()
        reward.plot(*zip(*rewards, strict=True), color="black", linewidth=1.0)
        reward.set_ylabel("reward mean so far")
    figure.suptitle(title, fontsize=9)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
