"""The RL loop of ``libra train``, top to bottom.

Open the run: the trainer's processes (they load the model while the rest starts), the
serving fleet (our own vLLM in dev mode on an untied copy of the model, or servers given
by URL, or the emulator), sandboxes, scheduler and engine (``libra.launch``), and one
rollout session for the whole run. Then, per step ``k``:

1. the step's jobs (``prompts_per_step`` tasks x ``samples_per_prompt``) are in the
   session: submitted after the last sync (``sync``), or while step ``k - 1`` trained
   (``one-step-off``: they sample on weights one version old, and ``grpo.max_staleness``
   decides in the batch builder what is too old);
2. collect the step's groups (each record was appended to ``rollouts/step-k.jsonl``, the
   durable trajectory log, as its trajectory ended: see ``_rollout_log``);
3. build the batch for weights at version ``k`` (versions count the loop's steps: the
   servers start on v0, and the weights after step ``k`` are ``v{k+1}``, even when no
   group carried a signal and the step changed nothing);
4. train one optimizer step (its forward pass also compares the trainer's logprobs with
   the server's on the tokens that weights ``k`` sampled: the trainer holds the same
   weights, so that gap is numerics only), export ``weights/v{k+1}``;
5. pause admission, load the folder into every endpoint, bump their versions, resume;
   when step 4 saw no token of weights ``k`` (``one-step-off`` sampled them all before
   the sync), probe instead: one record's ids, scored by the server now serving
   ``v{k+1}`` and by the trainer holding it;
6. write the step's line to ``metrics.jsonl`` (:class:`StepRecord`), write a checkpoint
   (every ``checkpoint_every`` steps), call the checkpoint hook (:class:`CheckpointHook`)
   with the run and the line;
7. with ``[alloc]`` (``_cluster``), the step's line also holds what the allocation loop
   decided from the step's timing (and every call's, taken as it ended): a hybrid unit
   that moves between serving and training does so beside the next step, and the
   trainer's world changes at a step boundary (``_elastic``); with ``[alloc.tail]`` the
   hybrid units the rollout leaves idle also join step 4's training under way, and go
   back when the next rollout's jobs are submitted (1).

``resume=True`` starts from the run folder's newest checkpoint instead of step 0: the
trainer's state is restored (and ``metrics.jsonl`` cut back to what it held then), the
servers serve the checkpoint's weight version again, and the loop goes on from its step
(each step's tasks are seeded by ``seed + step``: the step is the data position). The
records the log holds for that step and later, sampled by the checkpoint's weights or
older ones, are taken back instead of sampled again (their count is the step's
``reused``); the steps the killed run took after its checkpoint are re-run, and what
their later weights sampled is sampled again.

A trainer rank that dies stops the run at once (``TrainerProcess.watch``), whether it
was training or waiting for the next batch: the servers, sandboxes and session close on
the way out, the checkpoints on disk stay as they were (a partial one is never taken for
a complete one), and ``resume=True`` goes on from the newest.
"""

from __future__ import annotations

import json
import shutil
import statistics
import time
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable, Iterator
from contextlib import (
    AbstractAsyncContextManager,
    AbstractContextManager,
    nullcontext,
)
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Protocol

import anyio
import httpx

from libra.alloc import StepAllocation
from libra.engine import (
    Group,
    RolloutSession,
    RolloutStats,
    TrajectoryJob,
    TrajectoryRecord,
    jobs_for,
)
from libra.envs import Env, GroupId
from libra.fleet import Endpoint
from libra.sched import Scheduler
from libra.serving import WeightSync, WeightSyncError
from libra.train._gateway import Gateway
from libra.train._rollout_log import ROLLOUTS, RolloutLog, keep_reusable
from libra.train._settings import RunSettings
from libra.trainer import (
    Batch,
    Export,
    LogprobGap,
    Logprobs,
    Persistent,
    RestoreCheckpoint,
    RunState,
    Sample,
    Train,
    TrainerWorld,
    TrainResult,
    WriteCheckpoint,
    build_batch,
    find_latest,
    logprob_gap,
    server_prompt_logprobs,
)

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

    def to_json(self) -> str:
        line = asdict(self)
        if line["alloc"] is None:
            del line["alloc"]
        return json.dumps(line, sort_keys=False)


class CheckpointHook(Protocol):
    """Called after each step's metrics line is written: save what resuming needs."""

    def __call__(self, run: TrainRun, record: StepRecord) -> Awaitable[None]: ...


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
    run.submit(first)
    records: list[StepRecord] = []
    for step in range(first, run.config.steps):
        record = await run.step(step, progress)
        with (run.run_dir / METRICS_FILE).open("a") as out:
            out.write(record.to_json() + "\n")
        records.append(record)
        on_step(record)
        await run.save(step + 1)
        if checkpoint is not None:
            await checkpoint(run, record)
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
class ServedWeights:
    """The weights the servers should hold now: a server restarted mid-run is given these
    (``folder`` None: the ones the servers start on)."""

    folder: Path | None = None
    version: int = 0
    #: Held while new weights load into the fleet: an instance starting meanwhile takes
    #: them once the load is over.
    lock: anyio.Lock = field(default_factory=anyio.Lock)

    def __call__(self) -> tuple[Path | None, int]:
        return self.folder, self.version


@dataclass
class TrainRun:
    """A running loop's parts: what a checkpoint hook may read (and, for a resume, set)."""

    config: RunSettings
    run_dir: Path
    env_cls: type[Env]
    env_name: str
    trainer: TrainerWorld
    session: RolloutSession
    endpoints: list[Endpoint]
    scheduler: Scheduler
    log: RolloutLog
    served: ServedWeights = field(default_factory=ServedWeights)
    gateway: Gateway | None = None  # a libra serve gateway: syncs go through its admin API
    allocation: StepAllocation | None = None  # [alloc]: the pool and the loop that moves it
    #: What the scheduler learnt (C-MLFQ's prefix forest), saved with each checkpoint.
    forest: Callable[[], Persistent | None] = lambda: None
    version: int = 0  # the weights the trainer holds: v0 before the first step
    groups: dict[int, list[Group]] = field(default_factory=lambda: defaultdict(list))
    # Records of groups not complete yet, and the ids of the groups submitted, by group.
    _gathering: dict[str, list[TrajectoryRecord]] = field(default_factory=dict)
    _group_ids: dict[str, GroupId] = field(default_factory=dict)
    # The jobs submitted and not yet recorded (a failed one may run again), and the runs
    # again of each step's failed trajectories.
    _jobs: dict[str, TrajectoryJob] = field(default_factory=dict)
    retried: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    _attempts: Counter[str] = field(default_factory=Counter)
    # After a resume: the logged records each step may take back instead of sampling
    # them, and how many it took.
    _reusable: dict[int, list[TrajectoryRecord]] = field(default_factory=dict)
    reused: dict[int, int] = field(default_factory=dict)
    _changed: anyio.Event = field(default_factory=anyio.Event)
    _stream_ended: bool = False
    _train_s_per_position: float | None = None  # the last step's: what the tail expects

    # ------------------------------------------------------------------ checkpoints

    async def restore(self) -> int:
        """Restore the newest checkpoint into the trainer and the servers; its step."""
        state = await self.trainer.call(RestoreCheckpoint(self.run_dir))
        if state is None:  # checked before the run opened: only a concurrent delete
            raise NothingToResume(f"{self.run_dir} holds no checkpoint to resume from")
        self.version = state.weight_version
        self._forget_lost_weights(state.weight_version)
        self._reusable = keep_reusable(self.run_dir, state.step, state.weight_version)
        await self._serve_restored(state.weight_version)
        return state.step

    def _forget_lost_weights(self, version: int) -> None:
        """Remove the exports of versions after ``version``: steps the killed run took
        after its checkpoint, lost with it, which the resumed run exports anew."""
        for folder in (self.run_dir / "weights").glob("v*"):
            if folder.name[1:].isdigit() and int(folder.name[1:]) > version:
                shutil.rmtree(folder)

    async def _serve_restored(self, version: int) -> None:
        """Serve ``version`` again: its exported folder where it was kept (an export
        never overwrites one), else the restored trainer exports it anew."""
        if version == 0:  # what the servers start on
            return
        folder = self.run_dir / "weights" / f"v{version}"
        if not folder.is_dir():
            folder = await self.trainer.call(
                Export(self.run_dir, version, self.config.export_dtype)
            )
        await self._load(folder, version)

    async def save(self, steps_done: int) -> None:
        """Write a checkpoint after ``steps_done`` steps, if one is due."""
        every = self.config.checkpoint_every
        if every == 0 or (steps_done % every and steps_done != self.config.steps):
            return
        metrics = self.run_dir / METRICS_FILE
        state = RunState(
            step=steps_done,
            next_task=steps_done,  # step k's tasks are seeded by seed + k
            weight_version=self.version,
            metrics_bytes=metrics.stat().st_size if metrics.exists() else 0,
        )
        forest = self.forest()
        await self.trainer.call(
            WriteCheckpoint(self.run_dir, state, forest, keep_last=self.config.keep_last)
        )

    # ------------------------------------------------------------------ one step

    def submit(self, step: int) -> None:
        """Submit step ``step``'s jobs, but for those whose record the log gave back."""
        if step >= self.config.steps:
            return
        if self.allocation is not None and self.allocation.tail is not None:
            self.allocation.tail.give_back()  # the rollout's servers restart beside it
        jobs = jobs_for(
            self.env_cls,
            self.env_name,
            self.config.prompts_per_step * self.config.samples_per_prompt,
            samples_per_prompt=self.config.samples_per_prompt,
            seed=self.config.seed + step,
            step=step,
        )
        for job in jobs:
            self._group_ids[str(job.group_id)] = job.group_id
        logged = {r.id: r for r in self._reusable.pop(step, []) if not self._retries(r)}
        taken = [logged[str(job.id)] for job in jobs if str(job.id) in logged]
        submitted = [job for job in jobs if str(job.id) not in logged]
        self._jobs.update((str(job.id), job) for job in submitted)
        self.session.submit(submitted)
        self.reused[step] = len(taken)
        for record in taken:
            self._gather(record)

    async def step(self, step: int, progress: Progress) -> StepRecord:
        started = time.perf_counter()
        stats = self.session.step_stats.get(step, RolloutStats())  # none: all reused
        with progress(step, stats) as tick:
            groups = await self._groups_of(step, tick)
        rollout_s = time.perf_counter() - started
        if self.config.mode == "one-step-off":
            self.submit(step + 1)  # sampled on the current weights while this step trains
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
        async with self._lending_tail(built):
            result: TrainResult | None = await self.trainer.call_sized(train_on)
        batch = built[-1]
        train_s = time.perf_counter() - started
        self._train_s_per_position = train_s / max(1, batch.positions)
        export_s, sync_s = await self._publish(self.version + 1)
        self.version += 1
        if result is not None and result.loss.get("gap_tokens", 0) > 0:
            gap = LogprobGap(
                result.loss["gap_mean"], result.loss["gap_max"], int(result.loss["gap_tokens"])
            )
        else:
            gap = await self._probe_gap(step_records)
        if self.config.mode == "sync":
            self.submit(step + 1)
        seconds = (rollout_s, train_s, export_s, sync_s)
        record = _step_record(step, self, groups, batch, result, gap, seconds)
        if self.allocation is not None:
            timing = (rollout_s, train_s + export_s + sync_s)  # all the rollout waits for
            decided = self.allocation.after_step(step, timing, batch.trained_tokens, step_records)
            record = replace(record, alloc={"trained_on": batch.ranks, **decided})
        return record

    def _lending_tail(self, built: list[Batch]) -> AbstractAsyncContextManager[None]:
        """With ``[alloc.tail]``, from the second step: the hybrid units the rollout
        leaves idle join this training (``libra.alloc.TailLender``). What it has left is
        priced at the last step's seconds per input position (the prompts and tool
        returns cost a pass as the sampled tokens do)."""
        lender = self.allocation.tail if self.allocation is not None else None
        rate = self._train_s_per_position
        if lender is None or rate is None:
            return nullcontext()
        started = time.perf_counter()

        def left_s() -> float:
            positions = built[-1].positions if built else 0
            return rate * positions - (time.perf_counter() - started)

        return lender.lending(lambda: len(self._jobs), left_s)

    async def _groups_of(self, step: int, tick: Callable[[], None]) -> list[Group]:
        while len(self.groups[step]) < self.config.prompts_per_step:
            if self._stream_ended:
                raise RuntimeError(f"the rollout session ended before step {step}'s groups")
            seen = len(self.groups[step])
            await self._changed.wait()
            for _ in range(len(self.groups[step]) - seen):
                tick()
        return self.groups.pop(step)

    async def read_records(self) -> None:
        """Log each record as its trajectory ends, and sort complete groups by step (one
        reader for the run). Nothing awaits between a record's arrival and its write."""
        async for record in self.session.records():
            if self._runs_again(record):
                continue
            self._jobs.pop(record.id, None)
            self._attempts.pop(record.id, None)
            self.log.append(record)
            self._gather(record)
        self._stream_ended = True
        self._changed.set()

    def _retries(self, record: TrajectoryRecord) -> bool:
        """Whether ``record``'s trajectory runs again rather than counts as it is."""
        return self.config.train.failures == "retry" and record.status == "failed"

    def _runs_again(self, record: TrajectoryRecord) -> bool:
        """Submit a failed trajectory again while it has retries left. The failed run's
        record is not kept: the trajectory's one record is that of its last run."""
        if not self._retries(record) or self._attempts[record.id] >= self.config.train.max_retries:
            return False
        self._attempts[record.id] += 1
        self.retried[record.step] += 1
        self.session.submit([self._jobs[record.id]])
        return True

    def _gather(self, record: TrajectoryRecord) -> None:
        """Add ``record`` to its group; a group whose samples are all in goes to its step."""
        members = self._gathering.setdefault(record.group_id, [])
        members.append(record)
        if len(members) < self.config.samples_per_prompt:
            return
        del self._gathering[record.group_id]
        members.sort(key=lambda member: member.sample)
        group = Group(self._group_ids.pop(record.group_id), tuple(members))
        self.groups[record.step].append(group)
        self._changed.set()
        self._changed = anyio.Event()

    async def _probe_gap(self, records: list[TrajectoryRecord]) -> LogprobGap:
        """Trainer versus the first server on the longest exact record's ids, both at the
        weights just synced (prompt logprobs are raw: temperature 1 on both sides)."""
        exact = [r for r in records if r.tokens == "exact" and len(r.token_ids) > 1]
        # A gateway serves no prompt logprobs: there the gap is the trained tokens' only.
        if not exact or not self.config.reloads or not self.endpoints or self.gateway:
            return LogprobGap(mean_abs=0.0, max_abs=0.0, tokens=0)
        ids = max(exact, key=lambda r: len(r.token_ids)).token_ids
        endpoint = await self._serving_endpoint()
        async with httpx.AsyncClient(timeout=self.config.sync.timeout_s) as client:
            served = await server_prompt_logprobs(client, endpoint.url, endpoint.model, ids)
        mine = await self.trainer.call(Logprobs(tuple(ids)))
        return logprob_gap(mine, served)

    async def _publish(self, version: int) -> tuple[float, float]:
        """Export ``version`` and load it into every endpoint (admission paused meanwhile)."""
        started = time.perf_counter()
        folder = await self.trainer.call(Export(self.run_dir, version, self.config.export_dtype))
        export_s = time.perf_counter() - started
        sync_s = await self._load(folder, version)
        self._forget_old_weights(version)
        return export_s, sync_s

    async def _load(self, folder: Path, version: int) -> float:
        """Load ``folder`` into every endpoint as ``version``; the seconds it took. A
        server that is down (or goes down meanwhile) is skipped: its supervisor gives it
        these weights when it restarts."""
        async with self.served.lock:
            return await self._load_locked(folder, version)

    async def _load_locked(self, folder: Path, version: int) -> float:
        self.served.folder, self.served.version = folder, version
        self.session.pause()
        started = time.perf_counter()
        try:
            if not self.config.reloads:  # servers that hold no weights: only the version
                for endpoint in self.endpoints:
                    endpoint.weight_version = version
                return 0.0
            if self.gateway is not None:
                return await self._load_through_gateway(self.gateway, folder, version)
            # The router's, not the run's first ones: the pool adds and removes instances.
            endpoints = self.scheduler.router.endpoints().values()
            live = [e for e in endpoints if self._serving(e.name)]
            sync = WeightSync(live, self.config.sync, self.session.engine.http)
            try:
                await sync.sync(folder, version)
            except WeightSyncError as error:
                if any(self._serving(name) for name in error.failed):
                    raise
            return time.perf_counter() - started
        finally:
            self.session.resume()

    async def _load_through_gateway(self, gateway: Gateway, folder: Path, version: int) -> float:
        """The gateway's fleet loads ``folder`` (and says it did); then the one endpoint
        the engine sees, the gateway, serves ``version`` and the records say so."""
        seconds = await gateway.sync(folder, version)
        for endpoint in self.endpoints:
            endpoint.weight_version = version
        return seconds

    async def _serving_endpoint(self) -> Endpoint:
        """The first endpoint that serves now: one that is down is waited for (its
        supervisor restarts it with the weights just synced)."""
        while True:
            for endpoint in self.endpoints:
                if self._serving(endpoint.name):
                    return endpoint
            await self.scheduler.router.membership.wait()

    def _serving(self, name: str) -> bool:
        instance = self.scheduler.router.by_name.get(name)
        return instance is not None and not instance.marked_down

    def _forget_old_weights(self, version: int) -> None:
        """Keep the served version, the one before it, and v0 (the servers' start folder,
        the model they were launched on): each version is the size of the model."""
        if version - 2 >= 1:
            shutil.rmtree(self.run_dir / "weights" / f"v{version - 2}", ignore_errors=True)


def _step_record(
    step: int,
    run: TrainRun,
    groups: list[Group],
    batch: Batch,
    result: TrainResult | None,
    gap: LogprobGap,
    seconds: tuple[float, float, float, float],
) -> StepRecord:
    rollout_s, train_s, export_s, sync_s = seconds
    loss = result.loss if result else {}
    records = [r for group in groups for r in group.records]
    rewards = [r.reward for r in records if r.status != "failed" and r.reward is not None]
    trained_groups = {sample.group for sample in batch.samples}
    statuses: dict[str, int] = defaultdict(int)
    for r in records:
        statuses[r.status] += 1
    return StepRecord(
        step=step,
        version=run.version - 1,
        trajectories=len(records),
        statuses=dict(statuses),
        reward_mean=statistics.fmean(rewards) if rewards else None,
        reward_std=statistics.pstdev(rewards) if rewards else None,
        response_tokens_mean=statistics.fmean(sum(r.loss_mask) for r in records)
        if records
        else 0.0,
        groups=len(groups),
        groups_used=len(trained_groups),
        samples_trained=len(batch.samples),
        dropped=dict(batch.dropped),
        tokens_trained=batch.trained_tokens,
        rollout_s=rollout_s,
        train_s=train_s,
        export_s=export_s,
        sync_s=sync_s,
        weight_version=run.version,
        logprob_gap_mean=gap.mean_abs,
        logprob_gap_max=gap.max_abs,
        logprob_gap_tokens=gap.tokens,
        loss=loss,
        grad_norm=result.step.grad_norm if result else None,
        lr=result.step.lr if result else None,
        reused=run.reused.get(step, 0),
        retried=run.retried.get(step, 0),
    )


def iter_metrics(run_dir: Path) -> Iterator[dict[str, object]]:
    """The metrics lines of a run folder, as written."""
    with (run_dir / METRICS_FILE).open() as lines:
        for line in lines:
            if line.strip():
                yield json.loads(line)
