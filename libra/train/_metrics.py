"""A run's metrics: one :class:`StepRecord` a step, a line of ``metrics.jsonl``."""

from __future__ import annotations

import json
import statistics
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from libra.engine import Group, TrajectoryRecord
from libra.trainer import Batch, LogprobGap, TrainResult

METRICS_FILE = "metrics.jsonl"


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One line of ``metrics.jsonl``: step ``step`` trained weights ``version`` into
    ``version + 1``. Seconds: ``rollout_s`` the loop waited for the step's groups
    (in ``one-step-off`` most of the rollout hides behind the previous step's training),
    ``train_s`` the optimizer step, ``export_s`` the weights written, ``sync_s`` loaded
    into every endpoint. ``logprob_gap_*``: trainer versus server on the trained tokens
    that weights ``version`` sampled, or else on the probe after the sync (``tokens`` 0:
    neither had a token to compare, as with an emulated server)."""

    step: int
    version: int
    trajectories: int
    statuses: dict[str, int]
    reward_mean: float | None
    reward_std: float | None
    response_tokens_mean: float
    groups: int
    groups_used: int
    samples_trained: int
    dropped: dict[str, int]
    tokens_trained: int
    rollout_s: float
    train_s: float
    export_s: float
    sync_s: float
    weight_version: int
    logprob_gap_mean: float
    logprob_gap_max: float
    logprob_gap_tokens: int
    loss: dict[str, float] = field(default_factory=dict)
    grad_norm: float | None = None
    lr: float | None = None
    reused: int = 0  # trajectories read back from the log of a killed run, not sampled
    retried: int = 0  # runs again of failed trajectories (train.failures = "retry")
    #: With ``[alloc]``: the allocation loop's decision after the step and where the
    #: workers are (absent from the line otherwise).
    alloc: dict[str, object] | None = None
    #: In a mixture of envs: per env of the step, its trajectories, statuses, reward
    #: mean and std and response tokens, as the step's own (absent otherwise).
    envs: dict[str, dict[str, object]] | None = None

    def to_json(self) -> str:
        line = asdict(self)
        for optional in ("alloc", "envs"):
            if line[optional] is None:
                del line[optional]
        return json.dumps(line, sort_keys=False)


def step_record(
    step: int,
    version: int,
    groups: list[Group],
    batch: Batch,
    result: TrainResult | None,
    gap: LogprobGap,
    seconds: tuple[float, float, float, float],
    *,
    reused: int = 0,
    retried: int = 0,
    by_env: bool = False,
) -> StepRecord:
    """Step ``step``'s line: it trained ``batch`` from ``groups`` and now holds weights
    ``version``; ``seconds``: its rollout, training, export and sync; ``by_env``: the
    run mixes envs (the line has each one's figures too)."""
    rollout_s, train_s, export_s, sync_s = seconds
    loss = result.loss if result else {}
    records = [r for group in groups for r in group.records]
    trained_groups = {sample.group for sample in batch.samples}
    envs: dict[str, list[TrajectoryRecord]] = defaultdict(list)
    for r in records:
        envs[r.env].append(r)
    return StepRecord(
        step=step,
        version=version - 1,
        **outcomes(records),
        groups=len(groups),
        groups_used=len(trained_groups),
        samples_trained=len(batch.samples),
        dropped=dict(batch.dropped),
        tokens_trained=batch.trained_tokens,
        rollout_s=rollout_s,
        train_s=train_s,
        export_s=export_s,
        sync_s=sync_s,
        weight_version=version,
        logprob_gap_mean=gap.mean_abs,
        logprob_gap_max=gap.max_abs,
        logprob_gap_tokens=gap.tokens,
        loss=loss,
        grad_norm=result.step.grad_norm if result else None,
        lr=result.step.lr if result else None,
        reused=reused,
        retried=retried,
        envs={env: outcomes(of_env) for env, of_env in sorted(envs.items())} if by_env else None,
    )


def outcomes(records: list[TrajectoryRecord]) -> dict[str, Any]:
    """What ``records`` came to: their count, statuses, rewards and lengths."""
    rewards = [r.reward for r in records if r.status != "failed" and r.reward is not None]
    return {
        "trajectories": len(records),
        "statuses": dict(Counter(r.status for r in records)),
        "reward_mean": statistics.fmean(rewards) if rewards else None,
        "reward_std": statistics.pstdev(rewards) if rewards else None,
        "response_tokens_mean": statistics.fmean(sum(r.loss_mask) for r in records)
        if records
        else 0.0,
    }


def iter_metrics(run_dir: Path) -> Iterator[dict[str, object]]:
    """The metrics lines of a run folder, as written."""
    with (run_dir / METRICS_FILE).open() as lines:
        for line in lines:
            if line.strip():
                yield json.loads(line)
