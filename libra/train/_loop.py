"""The RL loop of ``libra train``, top to bottom.

The run comes open (``libra.launch.open_run``): the trainer's processes, the serving
fleet (our own vLLM in dev mode on an untied copy of the model, or servers given by URL,
or the emulator), sandboxes, scheduler and engine, and one rollout session for the whole
run. Then, per step ``k``:

1. the step's jobs (``prompts_per_step`` tasks x ``samples_per_prompt``) are in the
   session: submitted after the last sync (``sync``), or while step ``k - 1`` trained
   (``one-step-off``: they sample on weights one version old), or while step
   ``k - max_ahead`` trained (``async``: up to ``max_ahead`` versions old); either way
   ``grpo.max_staleness`` decides in the batch builder what is too old;
2. collect the step's groups (``_groups``: each record was appended to
   ``rollouts/step-k.jsonl``, the durable trajectory log, as its trajectory ended: see
   ``_rollout_log``);
3. build the batch for weights at version ``k`` (versions count the loop's steps: the
   servers start on v0, and the weights after step ``k`` are ``v{k+1}``, even when no
   group carried a signal and the step changed nothing);
4. train one optimizer step (its forward pass also compares the trainer's logprobs with
   the server's on the tokens that weights ``k`` sampled: the trainer holds the same
   weights, so that gap is numerics only), export ``weights/v{k+1}``;
5. pause admission, load the folder into every endpoint, bump their versions, resume
   (``_publish``); when step 4 saw no token of weights ``k`` (``one-step-off`` sampled
   them all before the sync), probe instead: one record's ids, scored by the server now
   serving ``v{k+1}`` and by the trainer holding it;
6. write the step's line to ``metrics.jsonl`` (:class:`StepRecord`, ``_metrics``), write
   a checkpoint (every ``checkpoint_every`` steps), call the checkpoint hook
   (:class:`CheckpointHook`) with the run and the line;
7. with ``[alloc]`` (``libra.workers``, seen here as a ``libra.alloc.StepAllocation``),
   the step's line also holds what the allocation loop decided from the step's timing
   (and every call's, taken as it ended): a hybrid unit that moves between serving and
   training does so beside the next step, and the trainer's world changes at a step
   boundary; with ``[alloc.tail]`` the hybrid units the rollout leaves idle also join
   step 4's training under way, and go back when the next rollout's jobs are submitted
   (1). The loop only says when (``allocation.training`` around step 4,
   ``allocation.rollout_submitted`` at 1): what lending pays, and when, is the
   allocation's to price.

``resume=True`` starts from the run folder's newest checkpoint instead of step 0: the
trainer's state is restored (and ``metrics.jsonl`` cut back to what it held then), the
servers serve the checkpoint's weight version again, and the loop goes on from its step
(each step's tasks follow from the seed and the step, ``_tasks.py``: the step is the
data position). The records the log holds for that step and later, sampled by the
checkpoint's weights or older ones, are taken back instead of sampled again (their
count is the step's ``reused``); the steps the killed run took after its checkpoint are
re-run, and what their later weights sampled is sampled again.

A trainer rank that dies stops the run at once (``TrainerProcess.watch``), whether it
was training or waiting for the next batch: the servers, sandboxes and session close on
the way out, the checkpoints on disk stay as they were (a partial one is never taken for
a complete one), and ``resume=True`` goes on from the newest.
"""

from __future__ import annotations

import shutil
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager, AbstractContextManager, nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import anyio
import anyio.abc

from libra.alloc import StepAllocation
from libra.engine import RolloutSession, RolloutStats
from libra.fleet import Endpoint
from libra.sched import Scheduler
from libra.train._eval import Evaluation
from libra.train._gateway import GatewayClient
from libra.train._groups import GroupSource
from libra.train._metrics import METRICS_FILE, StepRecord, step_record
from libra.train._publish import Publisher, ServedWeights
from libra.train._rollout_log import ROLLOUTS, RolloutLog, keep_reusable
from libra.train._settings import RunSettings
from libra.trainer import (
    Batch,
    LogprobGap,
    Persistent,
    RestoreCheckpoint,
    RunState,
    Sample,
    Train,
    TrainerWorld,
    TrainResult,
    WriteCheckpoint,
    build_batch,
    checkpoint_path,
    find_latest,
    mark_best,
    read_best,
)


class CheckpointHook(Protocol):
    """Called after each step's metrics line is written: save what resuming needs."""

    def __call__(self, run: TrainRun, record: StepRecord) -> Awaitable[None]: ...


class RunObserver(Protocol):
    """What watches the run from outside it (what puts it on the run's event stream):
    each step's line once written, each evaluation's, each checkpoint once complete."""

    def step(self, record: StepRecord) -> Awaitable[None]: ...

    def evaluation(self, line: dict[str, Any]) -> Awaitable[None]: ...

    def checkpoint(self, steps_done: int, path: Path) -> Awaitable[None]: ...


Progress = Callable[[int, RolloutStats], AbstractContextManager[Callable[[], None]]]


def no_progress(step: int, stats: RolloutStats) -> AbstractContextManager[Callable[[], None]]:
    return nullcontext(lambda: None)


class NothingToResume(FileNotFoundError):
    """``resume=True`` on a run folder without a complete checkpoint."""


async def run_steps(
    run: TrainRun,
    *,
    resume: bool = False,
    checkpoint: CheckpointHook | None = None,
    on_step: Callable[[StepRecord], None] = lambda record: None,
    progress: Progress = no_progress,
) -> list[StepRecord]:
    """Run the run's steps (from its newest checkpoint's step with ``resume``); returns
    the metrics lines of the steps it ran (also in the run folder)."""
    first = await run.restore() if resume else 0
    for step in range(first, first + max(1, run.config.ahead)):
        run.submit(step)
    records: list[StepRecord] = []
    # (a task group only where evaluations run beside the steps: a step's error comes
    # out as it always did otherwise)
    evaluating = anyio.create_task_group() if run.evaluation is not None else None
    async with evaluating or nullcontext() as evaluations:
        run.evaluate(first, evaluations)
        for step in range(first, run.config.steps):
            record = await run.step(step, progress)
            with (run.run_dir / METRICS_FILE).open("a") as out:
                out.write(record.to_json() + "\n")
            records.append(record)
            on_step(record)
            for observer in run.observers:
                await observer.step(record)
            await run.save(step + 1)
            if checkpoint is not None:
                await checkpoint(run, record)
            run.evaluate(step + 1, evaluations)
    return records


def prepare_run_dir(run_dir: Path, config_toml: str, *, resume: bool) -> Path:
    """The run folder, ready for a new run (or, with ``resume``, one that has a checkpoint
    to go on from), holding the run's resolved config."""
    if resume and find_latest(run_dir) is None:
        raise NothingToResume(f"{run_dir} holds no checkpoint to resume from")
    if not resume and (run_dir / METRICS_FILE).exists():
        raise FileExistsError(f"{run_dir} holds a run already: choose another run_dir")
    if not resume:  # records of a run killed before its first step's line: not this run's
        shutil.rmtree(run_dir / ROLLOUTS, ignore_errors=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.toml").write_text(config_toml)
    return run_dir


@dataclass
class TrainRun:
    """A running loop's parts: what a checkpoint hook may read (and, for a resume, set).
    Its steps' groups come from ``rollouts``: :class:`StepGroups` (the run's own jobs)
    or ``OnlineGroups`` (sessions agents elsewhere played); its weights go to the
    servers through :class:`Publisher` (``publisher``)."""

    config: RunSettings
    run_dir: Path
    rollouts: GroupSource
    trainer: TrainerWorld
    session: RolloutSession
    endpoints: list[Endpoint]
    scheduler: Scheduler
    log: RolloutLog
    served: ServedWeights = field(default_factory=ServedWeights)
    gateway: GatewayClient | None = None  # a libra serve gateway: syncs go through its admin API
    allocation: StepAllocation | None = None  # [alloc]: the pool and the loop that moves it
    #: What the scheduler learnt (C-MLFQ's prefix forest), saved with each checkpoint.
    forest: Callable[[], Persistent | None] = lambda: None
    evaluation: Evaluation | None = None  # [eval]: held-apart tasks on the weights
    #: What watches the run (the event stream's publisher).
    observers: list[RunObserver] = field(default_factory=list)
    _evaluated: anyio.Event | None = None  # set when the evaluation under way is done
    version: int = 0  # the weights the trainer holds: v0 before the first step
    publisher: Publisher = field(init=False)

    def __post_init__(self) -> None:
        self.publisher = Publisher(
            self.config,
            self.run_dir,
            self.trainer,
            self.session,
            self.endpoints,
            self.scheduler,
            self.served,
            self.gateway,
        )

    # ------------------------------------------------------------------ checkpoints

    async def restore(self) -> int:
        """Restore the newest checkpoint into the trainer and the servers; its step."""
        state = await self.trainer.call(RestoreCheckpoint(self.run_dir))
        if state is None:  # checked before the run opened: only a concurrent delete
            raise NothingToResume(f"{self.run_dir} holds no checkpoint to resume from")
        self.version = state.weight_version
        self.publisher.forget_lost_weights(state.weight_version)
        self.rollouts.reusable = keep_reusable(self.run_dir, state.step, state.weight_version)
        if self.evaluation is not None:
            self.evaluation.forget_after(state.step)
        await self.publisher.serve_restored(state.weight_version)
        return state.step

    async def save(self, steps_done: int) -> None:
        """Write a checkpoint after ``steps_done`` steps, if one is due."""
        every = self.config.checkpoint_every
        if every == 0 or (steps_done % every and steps_done != self.config.steps):
            return
        metrics = self.run_dir / METRICS_FILE
        state = RunState(
            step=steps_done,
            next_task=steps_done,  # step k's tasks follow from the seed and k
            weight_version=self.version,
            metrics_bytes=metrics.stat().st_size if metrics.exists() else 0,
        )
        forest = self.forest()
        await self.trainer.call(
            WriteCheckpoint(self.run_dir, state, forest, keep_last=self.config.keep_last)
        )
        for observer in self.observers:
            await observer.checkpoint(steps_done, checkpoint_path(self.run_dir, steps_done))

    # ------------------------------------------------------------------ one step

    def submit(self, step: int) -> None:
        """Submit step ``step``'s jobs, but for those whose record the log gave back."""
        if step >= self.config.steps:
            return
        if self.allocation is not None:
            self.allocation.rollout_submitted()
        self.rollouts.submit(step)

    async def step(self, step: int, progress: Progress) -> StepRecord:
        started = time.perf_counter()
        stats = self.session.step_stats.get(step, RolloutStats())  # none: all reused
        with progress(step, stats) as tick:
            groups = await self.rollouts.of_step(step, tick)
        rollout_s = time.perf_counter() - started
        if self.config.ahead:  # sampled on the current weights while this step trains
            self.submit(step + self.config.ahead)
        self.log.finish(step)
        step_records = [r for group in groups for r in group.records]
        samples = [Sample.from_record(r) for r in step_records]
        built: list[Batch] = []

        def train_on(ranks: int) -> Train | None:  # split over the ranks that train it
            built.append(
                build_batch(
                    samples,
                    current_version=self.version,
                    grpo=self.config.grpo,
                    train=self.config.train,
                    ranks=ranks,
                )
            )
            grpo, temperature = self.config.grpo, self.config.trainer_temperature
            return Train(built[-1], grpo, temperature) if built[-1].micro_batches else None

        started = time.perf_counter()
        async with self._training(built):
            result: TrainResult | None = await self.trainer.call_sized(train_on)
        batch = built[-1]
        train_s = time.perf_counter() - started
        if self._evaluated is not None:  # every call of an evaluation sees one version
            await self._evaluated.wait()
        export_s, sync_s = await self.publisher.publish(self.version + 1)
        self.version += 1
        if result is not None and result.loss.get("gap_tokens", 0) > 0:
            gap = LogprobGap(
                result.loss["gap_mean"], result.loss["gap_max"], int(result.loss["gap_tokens"])
            )
        else:
            gap = await self.publisher.probe_gap(step_records)
        if not self.config.ahead:
            self.submit(step + 1)
        seconds = (rollout_s, train_s, export_s, sync_s)
        record = step_record(
            step,
            self.version,
            groups,
            batch,
            result,
            gap,
            seconds,
            reused=self.rollouts.reused.get(step, 0),
            retried=self.rollouts.retried.get(step, 0),
            by_env=self.config.mixed,
        )
        if ended_apart := self.rollouts.dropped.pop(step, None):
            record = replace(record, dropped=dict(Counter(record.dropped) + ended_apart))
        if self.allocation is not None:
            timing = (rollout_s, train_s + export_s + sync_s)  # all the rollout waits for
            decided = self.allocation.after_step(step, timing, batch.trained_tokens, step_records)
            record = replace(record, alloc={"trained_on": batch.ranks, **decided})
        return record

    def evaluate(self, steps_done: int, group: anyio.abc.TaskGroup | None) -> None:
        """Start the evaluation of the weights after ``steps_done`` steps in ``group``,
        if one is due: beside the next step, which syncs newer weights only once it is
        done."""
        evaluation = self.evaluation
        if evaluation is None or group is None:
            return
        if not evaluation.due(steps_done, self.config.steps):
            return
        done = self._evaluated = anyio.Event()

        async def run() -> None:
            try:
                line = await evaluation.run(steps_done, self.version)
                self._keep_if_best(steps_done, line)
                for observer in self.observers:
                    await observer.evaluation(line)
            finally:
                done.set()

        group.start_soon(run)

    def _keep_if_best(self, steps_done: int, line: dict[str, Any]) -> None:
        """With ``keep_best``: mark the checkpoint after ``steps_done`` steps to be kept
        if its evaluation beat every earlier one (a step with no checkpoint, as the
        start, is not a candidate; the next checkpoint's prune reads the mark, and the
        loop syncs no newer weights, so writes none, before this is done)."""
        metric = self.config.keep_best
        if metric is None or not checkpoint_path(self.run_dir, steps_done).is_dir():
            return
        _, env, figure = metric.split("/")
        value = line["envs"].get(env, {}).get(figure)
        best = read_best(self.run_dir)
        if value is not None and (best is None or value > best["value"]):
            mark_best(self.run_dir, steps_done, metric, value)

    def _training(self, built: list[Batch]) -> AbstractAsyncContextManager[None]:
        """The step's training, as the allocation wraps it (``[alloc.tail]`` lends it
        the hybrid units the rollout leaves idle)."""
        if self.allocation is None:
            return nullcontext()
        positions = lambda: built[-1].positions if built else 0  # noqa: E731
        return self.allocation.training(positions, lambda: self.rollouts.jobs_left)

    async def read_records(self) -> None:
        """Log each record as its trajectory ends, and sort complete groups by step (one
        reader for the run)."""
        await self.rollouts.read_records()
