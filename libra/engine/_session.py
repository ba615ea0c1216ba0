"""A rollout session: one object that runs trajectories for as long as training lasts.

A :class:`RolloutSession` wraps an :class:`Engine` across RL steps::

    async with RolloutSession(engine) as session:
        session.submit(jobs_for(Calc, "calc", 64, samples_per_prompt=8, step=0))
        async for group in session.groups():  # every sample of a (step, task) ended
            ...                               # train; submit the next step's jobs

- ``submit(jobs)`` never blocks: jobs queue, and run as soon as admission allows, at most
  ``concurrency`` at a time (:meth:`RolloutSession.set_concurrency` changes it while they
  run; a lower limit lets the trajectories in flight finish). Jobs of several steps may
  be in flight at once: their ids (:class:`~libra.envs.TrajectoryId`) carry the step, so
  the scheduler keeps them apart.
- Every trajectory that starts ends in exactly one record, which comes out of the
  session's stream: :meth:`RolloutSession.records` (or ``async for record in session``),
  or :meth:`RolloutSession.groups`, which gathers them into GRPO groups. Each record
  reaches exactly one reader: read one view, from one task.
- The stream holds at most ``engine.config.buffer`` records. When it is full, a
  finished trajectory waits, keeping its place (its concurrency slot), until the reader
  takes one: a trainer that stops reading stops admission, and no more than
  ``buffer + concurrency`` records are ever held.
- :meth:`RolloutSession.pause` stops admission (for a weight sync): trajectories in
  flight go on, queued jobs wait for :meth:`RolloutSession.resume`.
- :meth:`RolloutSession.drain` waits until everything submitted has ended;
  :meth:`RolloutSession.close` says no more jobs will come, so the stream ends once
  they have; :meth:`RolloutSession.cancel` stops now.
- Leaving the ``async with`` block cancels whatever still runs (call ``close`` and read
  the stream to its end, or ``drain``, first): trajectories in flight are recorded as
  cancelled, and their records stay readable (:meth:`RolloutSession.unread`); queued
  jobs never start and leave no record, as they never entered the engine.

The stream is a small bounded queue rather than an anyio memory object stream: a
cancelled trajectory's record must be delivered exactly once, even when the buffer is
full and nobody reads, and a cancelled ``send`` cannot say whether its item went
through. Such records go in past the bound.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from types import TracebackType
from typing import Protocol

import anyio
import anyio.abc

from libra.engine._engine import Engine
from libra.engine._gc import fewer_collections
from libra.engine._job import TrajectoryJob
from libra.engine._records import TrajectoryRecord
from libra.engine._stats import RolloutStats
from libra.engine._trajectory import run_trajectory
from libra.engine._watch import warn_while_stalled
from libra.envs import GroupId, TrajectoryId
from libra.sched import Pulse


@dataclass(frozen=True, slots=True)
class Group:
    """Every sample of one task at one step, in sample order, once all have ended.

    The rule for failed samples: a group is complete when all its samples have ended,
    however they ended. Failed ones (a server fault, a cancellation, an env error: never
    the model's doing) stay in ``records`` and are listed apart in ``failed``; the
    trainer decides whether ``ok`` is enough to learn from.
    """

    id: GroupId
    records: tuple[TrajectoryRecord, ...]

    @property
    def ok(self) -> tuple[TrajectoryRecord, ...]:
        return tuple(r for r in self.records if r.status != "failed")

    @property
    def failed(self) -> tuple[TrajectoryRecord, ...]:
        return tuple(r for r in self.records if r.status == "failed")


_Ended = tuple[TrajectoryJob, TrajectoryRecord]


class TrajectoryRunner(Protocol):
    """Plays one job to its record: :func:`run_trajectory` (an env's episode), or an
    agent's (``libra.agents.AgentRunner``). A cancelled run hands its record to
    ``on_cancelled`` before the cancellation goes on."""

    def __call__(
        self,
        job: TrajectoryJob,
        engine: Engine,
        *,
        on_cancelled: Callable[[TrajectoryRecord], None] | None = None,
    ) -> Awaitable[TrajectoryRecord]: ...


class _Outbox:
    """Finished trajectories waiting for the reader: bounded, and closed at the end."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.items: deque[_Ended] = deque()
        self.closed = False
        self._changes = Pulse()

    async def put(self, item: _Ended) -> None:
        """Wait for room, then add ``item``; cancelled, it has added nothing."""
        while len(self.items) >= self.size:
            await self._changes.wait()
        self.put_now(item)

    def put_now(self, item: _Ended) -> None:
        """Add ``item`` past the bound: for records that cannot wait (cancelled ones)."""
        self.items.append(item)
        self._changes.fire()

    async def get(self) -> _Ended | None:
        """The next item, or None once closed and empty."""
        while not self.items:
            if self.closed:
                return None
            await self._changes.wait()
        item = self.items.popleft()
        self._changes.fire()
        return item

    def close(self) -> None:
        self.closed = True
        self._changes.fire()


class RolloutSession:
    """Runs submitted jobs on ``engine`` and streams their records (see the module)."""

    def __init__(
        self,
        engine: Engine,
        *,
        stats: RolloutStats | None = None,
        runner: TrajectoryRunner = run_trajectory,
    ) -> None:
        self.engine = engine
        self.runner = runner
        #: Counters over the whole session (``total``: jobs submitted) and per step.
        self.stats = stats or RolloutStats()
        self.step_stats: dict[int, RolloutStats] = {}
        self._queue: deque[TrajectoryJob] = deque()
        self._unread: Counter[GroupId] = Counter()  # per group: records not yet read
        self._scopes: set[anyio.CancelScope] = set()  # one per running trajectory
        self._running = 0
        self._paused = False
        self._closed = False
        self._limiter = anyio.CapacityLimiter(engine.config.concurrency)
        self._outbox = _Outbox(engine.config.buffer)
        self._changes = Pulse()
        self._admission = anyio.CancelScope()
        self._watch = anyio.CancelScope()  # the stall warning's, ended with the session
        self._stack = AsyncExitStack()
        self._group: anyio.abc.TaskGroup | None = None

    # ---------------------------------------------------------------- lifetime

    async def __aenter__(self) -> RolloutSession:
        self._stack.enter_context(fewer_collections())
        self._group = await self._stack.enter_async_context(anyio.create_task_group())
        self.stats.started_at = anyio.current_time()
        self._group.start_soon(self._admit)
        self._group.start_soon(self._warn_while_stalled)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> bool | None:
        self.cancel()
        self._admission.cancel()
        self._watch.cancel()
        try:
            return await self._stack.__aexit__(exc_type, exc, traceback)
        finally:
            self.stats.elapsed_s = anyio.current_time() - self.stats.started_at

    # ------------------------------------------------------------------- control

    def submit(self, jobs: Iterable[TrajectoryJob]) -> None:
        """Queue ``jobs`` (without waiting); they start as admission allows, in order.

        Submit all the samples of a group in one call: a group is complete when the
        samples submitted so far have ended. Raises ``ValueError`` for a job whose id is
        already queued or running (in any session on the engine: the scheduler would mix
        the two up), ``RuntimeError`` once the session is closed.
        """
        if self._group is None or self._closed:
            raise RuntimeError("submit to an open session: inside `async with`, before close")
        jobs = list(jobs)
        seen: set[TrajectoryId] = set()
        for job in jobs:
            if job.id in self.engine.live_ids or job.id in seen:
                message = "is already in the session (queued or running on this engine)"
                raise ValueError(f"trajectory {job.id} {message}")
            seen.add(job.id)
        for job in jobs:
            self.engine.live_ids.add(job.id)
            self._unread[job.group_id] += 1
            self.stats.total += 1
            self._stats_of(job.step).total += 1
        self._queue.extend(jobs)
        self._changes.fire()

    def pause(self) -> None:
        """Start no more trajectories (those in flight go on) until :meth:`resume`."""
        self._paused = True

    def resume(self) -> None:
        self._paused = False
        self._changes.fire()

    def set_concurrency(self, limit: int) -> None:
        """At most ``limit`` trajectories in flight from now on; lowering it lets the
        ones in flight finish, and starts no more until fewer than ``limit`` run."""
        if limit < 1:
            raise ValueError(f"concurrency must be at least 1, not {limit}")
        self._limiter.total_tokens = limit

    async def drain(self) -> None:
        """Wait until everything submitted so far has ended and been handed to the stream
        (a paused session waits for :meth:`resume`; a full buffer, for its reader)."""
        while self._queue or self._running:
            await self._changes.wait()

    def close(self) -> None:
        """No more jobs: the stream ends once every job submitted has ended."""
        self._closed = True
        self._changes.fire()
        self._end_stream_if_done()

    def cancel(self) -> list[TrajectoryJob]:
        """Stop now: cancel the trajectories in flight (each is still recorded, as
        cancelled, in the stream) and drop the queued jobs, which are returned."""
        dropped = list(self._queue)
        self._queue.clear()
        self.engine.live_ids.difference_update(job.id for job in dropped)
        for scope in self._scopes:
            scope.cancel()
        self.close()
        return dropped

    # ------------------------------------------------------------------- reading

    def __aiter__(self) -> AsyncIterator[TrajectoryRecord]:
        return self.records()

    async def records(self) -> AsyncIterator[TrajectoryRecord]:
        """Records as trajectories end; the iteration ends once the session is closed
        (or cancelled) and every record has been read."""
        while (ended := await self._outbox.get()) is not None:
            self._read(ended[0].group_id)
            yield ended[1]

    async def groups(self) -> AsyncIterator[Group]:
        """Complete groups (see :class:`Group`), as their last sample ends. Groups that
        lost samples to :meth:`cancel` never complete and are not yielded."""
        gathered: dict[GroupId, list[_Ended]] = {}
        while (ended := await self._outbox.get()) is not None:
            group_id = ended[0].group_id
            members = gathered.setdefault(group_id, [])
            members.append(ended)
            if self._read(group_id):
                del gathered[group_id]
                members.sort(key=lambda member: member[0].sample)
                yield Group(group_id, tuple(record for _, record in members))

    def unread(self) -> list[TrajectoryRecord]:
        """Take the records in the stream now, without waiting (after a cancellation)."""
        taken = [record for _, record in self._outbox.items]
        for job, _ in self._outbox.items:
            self._read(job.group_id)
        self._outbox.items.clear()
        return taken

    def _read(self, group_id: GroupId) -> bool:
        """One record of ``group_id`` was read: True when it was the last one submitted
        (the count is dropped then, so a long session holds none of its past groups)."""
        self._unread[group_id] -= 1
        if self._unread[group_id] > 0:
            return False
        del self._unread[group_id]
        return True

    @property
    def in_flight(self) -> int:
        return self._running

    @property
    def open_groups(self) -> int:
        """Groups with records not read yet (what a long session keeps of its groups)."""
        return len(self._unread)

    @property
    def queued(self) -> int:
        return len(self._queue)

    @property
    def buffered(self) -> int:
        """Records in the stream, not yet read."""
        return len(self._outbox.items)

    @property
    def concurrency(self) -> int:
        return int(self._limiter.total_tokens)

    @property
    def paused(self) -> bool:
        return self._paused

    # --------------------------------------------------------------- the workings

    async def _admit(self) -> None:
        """Start queued jobs, in order, while admission is open and slots are free."""
        with self._admission:
            while True:
                while self._paused or not self._queue:
                    if self._closed and not self._queue:
                        return
                    await self._changes.wait()
                job = self._queue[0]
                try:  # without a checkpoint while slots are free: a burst starts at once
                    self._limiter.acquire_on_behalf_of_nowait(job.id)
                except anyio.WouldBlock:
                    await self._limiter.acquire_on_behalf_of(job.id)
                    if self._paused or not self._queue or self._queue[0] is not job:
                        self._limiter.release_on_behalf_of(job.id)  # changed while waiting
                        continue
                self._queue.popleft()
                self._start(job)

    async def _warn_while_stalled(self) -> None:
        with self._watch:
            await warn_while_stalled(self.engine.generations, self.engine.config.stall_warning_s)

    def _start(self, job: TrajectoryJob) -> None:
        assert self._group is not None
        scope = anyio.CancelScope()  # made now, so that cancel() reaches it at once
        self._scopes.add(scope)
        self._running += 1
        self._group.start_soon(self._run, job, scope, name="trajectory")  # (naming costs)

    async def _run(self, job: TrajectoryJob, scope: anyio.CancelScope) -> None:
        def hand_over_now(record: TrajectoryRecord) -> None:
            self._observe(job, record)
            self._outbox.put_now((job, record))

        try:
            with scope:
                record = await self.runner(job, self.engine, on_cancelled=hand_over_now)
                self._observe(job, record)
                try:  # it keeps its slot until the reader has room: the backpressure
                    await self._outbox.put((job, record))
                except anyio.get_cancelled_exc_class():
                    self._outbox.put_now((job, record))
                    raise
        finally:
            self._scopes.discard(scope)
            job_id = job.id  # (built anew on every read)
            self._limiter.release_on_behalf_of(job_id)
            self.engine.live_ids.discard(job_id)
            self._running -= 1
            self._changes.fire()
            self._end_stream_if_done()

    def _observe(self, job: TrajectoryJob, record: TrajectoryRecord) -> None:
        self.stats.observe(record)
        self._stats_of(job.step).observe(record)

    def _stats_of(self, step: int) -> RolloutStats:
        stats = self.step_stats.get(step)
        if stats is None:
            stats = self.step_stats[step] = RolloutStats(started_at=anyio.current_time())
        return stats

    def _end_stream_if_done(self) -> None:
        if self._closed and not self._queue and not self._running:
            self._outbox.close()
