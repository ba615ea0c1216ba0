"""``[tracking]`` in a training run: the trackers (``libra.tracking``) follow the run's
event stream (``libra.events``, what the live view and the events log read): each step's
line with its trajectories (read back from the step's durable log,
``rollouts/step-K.jsonl``), each evaluation's line and each checkpoint. They count
nothing of their own."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio

from libra.engine import TrajectoryRecord
from libra.events import CheckpointWritten, EvalEnded, EventBus, StepEnded, Subscription
from libra.launch._train_config import TrainRunConfig
from libra.tracking import RunStart, Sample, StepLog, Trackers, scalars
from libra.train import read_step
from libra.trainer import find_latest

_MESSAGE_CHARS = 2000  # of one message, in a sample's text


async def track(
    subscription: Subscription, trackers: Trackers, run_dir: Path, samples: int
) -> None:
    """Hand the trackers what the run's event stream says, in order, until the
    subscription closes: each step's line with its trajectories, each evaluation's line,
    each checkpoint. Logging runs in a worker thread (a tracker may write to disk or a
    database), so training never waits for it."""
    async for batch in subscription.batches():
        for event in batch:
            if isinstance(event, StepEnded):
                step = int(event.line["step"])
                records = await anyio.to_thread.run_sync(read_step, run_dir, step)
                entry = StepLog(
                    step, scalars(event.line), histograms(records), spread(records, samples)
                )
                await anyio.to_thread.run_sync(trackers.log, entry)
            elif isinstance(event, EvalEnded):
                line = event.line
                figures = {"eval/weight_version": float(line["weight_version"])}
                entry = StepLog(line["step"], figures | scalars(line["envs"], "eval/"))
                await anyio.to_thread.run_sync(trackers.log, entry)
            elif isinstance(event, CheckpointWritten):
                path = Path(event.path)
                await anyio.to_thread.run_sync(trackers.log_checkpoint, event.steps_done, path)


@asynccontextmanager
async def tracking(
    config: TrainRunConfig, run_dir: Path, resume: bool, bus: EventBus
) -> AsyncIterator[None]:
    """While the block runs, the run's trackers follow ``bus`` (none when ``[tracking]``
    names none); on the way out they take what is left, then close. (Opening and closing
    a tracker blocks, W&B's starts a service: in a worker thread.)"""
    settings = config.tracking
    if not settings.backends:
        yield
        return
    start = await anyio.to_thread.run_sync(run_start, config, run_dir, resume)
    trackers = await anyio.to_thread.run_sync(Trackers, settings, start)
    try:
        subscription = bus.subscribe()
        async with anyio.create_task_group() as group:
            group.start_soon(track, subscription, trackers, run_dir, settings.samples)
            try:
                yield
            finally:
                subscription.close()  # the trackers log what it holds, then stop
    finally:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(trackers.close)


def run_start(config: TrainRunConfig, run_dir: Path, resume: bool) -> RunStart:
    """The tracked run: its names, config, folder, and where a resume goes on from."""
    settings = config.tracking
    name = settings.run_name or run_dir.resolve().name
    latest = find_latest(run_dir) if resume else None
    return RunStart(
        name=name,
        project=settings.project,
        group=settings.group or name,
        tags=list(settings.tags),
        config=config.model_dump(mode="json"),
        config_toml=config.to_toml(),
        dir=settings.dir or run_dir / "tracking",
        resume_step=latest.run.step if latest is not None else None,
    )


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
