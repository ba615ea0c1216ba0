"""Live counters of a rollout: what a progress bar shows and the summary prints."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from libra._clock import now
from libra.engine._records import TrajectoryRecord


@dataclass
class RolloutStats:
    """Live counters of a rollout or a session's step: ``total`` counts the jobs submitted,
    ``done`` the records made."""

    total: int = 0
    statuses: Counter[str] = field(default_factory=Counter)
    reward_sum: float = 0.0
    rewarded: int = 0
    turns: int = 0
    tool_calls: int = 0
    tool_successes: int = 0
    with_tool_calls: int = 0  # trajectories that made at least one
    sampled_tokens: int = 0
    started_at: float = 0.0
    elapsed_s: float = 0.0
    interrupted: bool = False

    @property
    def done(self) -> int:
        return sum(self.statuses.values())

    @property
    def reward_mean(self) -> float | None:
        return self.reward_sum / self.rewarded if self.rewarded else None

    @property
    def trajectories_per_s(self) -> float:
        return self.done / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def observe(self, record: TrajectoryRecord) -> None:
        self.statuses[record.status] += 1
        self.turns += record.turns
        self.tool_calls += len(record.tool_returns)
        self.tool_successes += sum(r.status == "success" for r in record.tool_returns)
        self.with_tool_calls += bool(record.tool_returns)
        # The spans cover exactly the sampled tokens (the loss mask's ones): far fewer to add.
        self.sampled_tokens += sum(span.end - span.start for span in record.weight_versions)
        if record.reward is not None:
            self.reward_sum += record.reward
            self.rewarded += 1
        self.elapsed_s = now() - self.started_at
