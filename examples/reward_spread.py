"""Summarise a rollout file for GRPO: is the reward spread within groups of one task?

    python examples/reward_spread.py runs/demo.jsonl

GRPO learns only from groups (the samples of one task) whose rewards differ, so this
prints, beside the mean reward, the fraction of groups with non-zero reward variance.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any


def summary(all_records: list[dict[str, Any]]) -> dict[str, float]:
    # A failed trajectory (a fault, or cancelled) has no reward: it is not a zero.
    records = [r for r in all_records if r["status"] != "failed"]
    rewards = [r["reward"] or 0.0 for r in records]
    groups: dict[str, list[float]] = defaultdict(list)
    for record, reward in zip(records, rewards, strict=True):
        groups[record["task_id"]].append(reward)
    # Groups of one sample (an unfinished rollout's) say nothing about the spread.
    sampled = [g for g in groups.values() if len(g) > 1]
    spread = [g for g in sampled if statistics.pvariance(g) > 0]
    return {
        "trajectories": len(all_records),
        "failed": len(all_records) - len(records),
        "completed": sum(r["status"] == "completed" for r in records),
        "mean_reward": statistics.fmean(rewards),
        "groups": len(groups),
        "groups_sampled_twice": len(sampled),
        "groups_with_spread": len(spread) / max(len(sampled), 1),
        "full_credit": sum(reward == 1.0 for reward in rewards) / len(rewards),
        "mean_turns": statistics.fmean(r["turns"] for r in records),
        "tool_calls": sum(len(r["tool_returns"]) for r in records),
        "tool_failures": sum(t["status"] != "success" for r in records for t in r["tool_returns"]),
    }


def main(path: str) -> None:
    lines = Path(path).read_text().splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    for key, value in summary(records).items():
        print(f"{key:20} {value:.3f}" if isinstance(value, float) else f"{key:20} {value}")


if __name__ == "__main__":
    main(sys.argv[1])
