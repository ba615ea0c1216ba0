"""``[tracking]`` in a training run: each step's line with its trajectories (read back
from the step's durable log, ``rollouts/step-K.jsonl``), each evaluation's line and each
checkpoint, handed to the trackers (``libra.tracking``). The trackers read what the run
folder holds, not counts of their own."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

import anyio

from libra.engine import TrajectoryRecord
from libra.launch._train_config import TrainRunConfig
from libra.tracking import RunStart, Sample, StepLog, Trackers, scalars
from libra.train import StepRecord, read_step
from libra.trainer import find_latest

_MESSAGE_CHARS = 2000  # of one message, in a sample's text


class TrackedRun:
    """The trackers as the loop's :class:`~libra.train.RunObserver`. Logging runs in a
    worker thread (a tracker may write to disk or a database), one call at a time: an
    evaluation ends beside a step."""

    def __init__(self, trackers: Trackers, run_dir: Path, samples: int) -> None:
        self.trackers = trackers
        self.run_dir = run_dir
        self.samples = samples
        self._lock = anyio.Lock()

    async def step(self, record: StepRecord) -> None:
        records = await anyio.to_thread.run_sync(read_step, self.run_dir, record.step)
        entry = StepLog(
            record.step,
            scalars(asdict(record)),
            histograms(records),
            spread(records, self.samples),
        )
        await self._log(entry)

    async def evaluation(self, line: dict[str, Any]) -> None:
        figures = {"eval/weight_version": float(line["weight_version"])}
        await self._log(StepLog(line["step"], figures | scalars(line["envs"], "eval/")))

    async def checkpoint(self, steps_done: int, path: Path) -> None:
        async with self._lock:
            await anyio.to_thread.run_sync(self.trackers.log_checkpoint, steps_done, path)

    async def _log(self, entry: StepLog) -> None:
        async with self._lock:
            await anyio.to_thread.run_sync(self.trackers.log, entry)


@contextmanager
def open_tracking(
    config: TrainRunConfig, run_dir: Path, resume: bool
) -> Iterator[TrackedRun | None]:
    """The run's trackers (None when ``[tracking]`` names none), closed with the run."""
    tracking = config.tracking
    if not tracking.backends:
        yield None
        return
    name = tracking.run_name or run_dir.resolve().name
    latest = find_latest(run_dir) if resume else None
    start = RunStart(
        name=name,
        project=tracking.project,
        group=tracking.group or name,
        tags=list(tracking.tags),
        config=config.model_dump(mode="json"),
        config_toml=config.to_toml(),
        dir=tracking.dir or run_dir / "tracking",
        resume_step=latest.run.step if latest is not None else None,
    )
    with Trackers(tracking, start) as trackers:
        yield TrackedRun(trackers, run_dir, tracking.samples)


def histograms(records: list[TrajectoryRecord]) -> dict[str, list[float]]:
    """The step's rewards (of the trajectories that have one) and response lengths."""
    return {
        "hist/reward": [r.reward for r in records if r.reward is not None],
        "hist/response_tokens": [float(sum(r.loss_mask)) for r in records],
    }


def spread(records: list[TrajectoryRecord], count: int) -> list[Sample]:
    """``count`` trajectories spread over the step's rewards, lowest to highest."""
    if not records or count == 0:
        return []
    ranked = sorted(records, key=lambda r: (-math.inf if r.reward is None else r.reward, r.id))
    if count >= len(ranked):
        picked = ranked
    else:
        last = len(ranked) - 1
        picked = [ranked[round(i * last / max(1, count - 1))] for i in range(count)]
    unique = {record.id: record for record in picked}  # a short step picks one twice
    return [_sample(record) for record in unique.values()]


def _sample(record: TrajectoryRecord) -> Sample:
    lines = []
    for message in record.messages:
        text = (message.content or "")[:_MESSAGE_CHARS]
        for call in message.tool_calls or []:
            text += f"\n[calls {call.function.name}({call.function.arguments[:_MESSAGE_CHARS]})]"
        lines.append(f"{message.role}: {text}")
    return Sample(
        record.id,
        record.env,
        record.status,
        record.reward,
        record.turns,
        len(record.token_ids),
        "\n\n".join(lines),
    )
