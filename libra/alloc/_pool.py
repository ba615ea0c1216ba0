"""The elastic hybrid pool: hybrid workers move between serving and training while both run.

Workers are grouped in *units*: the workers one serving instance runs on (its TP is their
count). Core units stay where they are; a hybrid unit moves as a whole:

- **borrowed** (rollout → training): its instance is drained in the router (no new calls;
  its in-flight calls finish, and its trajectories' next turns go to the other
  instances), removed once drained (after ``drain_timeout_s`` the calls still running are
  cut and retried elsewhere), stopped; then each worker joins training through
  ``requested → fetching_state → zero_sync → activating → active``;
- **released** (training → rollout): its workers leave training, its instance starts
  again and rejoins the router.

Every phase is bounded by a timeout. A move that fails returns the unit to where it was:
a failed or hung join restarts its instance and re-adds it to the router; a failed start
joins training again. Moves run as tasks of the pool's task group: ``borrow`` and
``release`` return at once, and neither the rollout nor a training step waits for them.
Every worker's state and every transition (with its time) are kept for tests and plots.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Coroutine, Sequence
from types import TracebackType
from typing import Any, Self

import anyio
import anyio.abc

from libra.alloc._layout import Layout, PoolConfig, instance_name
from libra.alloc._moves import (
    Direction,
    Move,
    MoveFailed,
    Transition,
    Unit,
    WorkerState,
)
from libra.alloc._protocol import Cluster, Plan, Stage
from libra.fleet import InstanceSpec
from libra.sched import Router


class HybridPool:
    """Moves hybrid units between the router and the trainer (see the module docstring).

    Use it as an async context manager: moves run in its task group, and leaving it waits
    for the moves under way (each is bounded by its timeouts)."""

    def __init__(
        self,
        cluster: Cluster,
        router: Router,
        layout: Layout,
        config: PoolConfig | None = None,
    ) -> None:
        layout.check(cluster.workers)
        self.cluster = cluster
        self.router = router
        self.config = config or PoolConfig()
        self.units: list[Unit] = [Unit((w,), "core-training", "training") for w in layout.training]
        for workers, role in layout.units():
            live = router.by_name.get(instance_name(workers))
            if live is None:
                raise ValueError(f"{instance_name(workers)} serves nowhere: start it first")
            self.units.append(Unit(workers, role, "rollout", live.bucket))
        for workers, bucket in layout.lent:
            self.units.append(Unit(workers, "hybrid", "training", bucket))
        self.state: dict[int, WorkerState] = {}
        self.history: list[Transition] = []
        self.moves: list[Move] = []
        for unit in self.units:
            self._set(unit, "active" if unit.stage == "training" else "serving", "layout")
        self._group: anyio.abc.TaskGroup | None = None

    async def __aenter__(self) -> Self:
        self._group = anyio.create_task_group()
        await self._group.__aenter__()
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> bool | None:
        assert self._group is not None
        group, self._group = self._group, None
        return await group.__aexit__(kind, error, traceback)

    # ------------------------------------------------------------------ looking

    def workers_in(self, stage: Stage) -> int:
        """Workers that are (or are moving to be) in ``stage``: what a plan counts."""
        return sum(len(unit.workers) for unit in self.units if unit.stage == stage)

    def training_workers(self) -> tuple[int, ...]:
        """Workers taking a share of the batch now."""
        return tuple(sorted(w for w, state in self.state.items() if state == "active"))

    def pending(self) -> list[Move]:
        return [move for move in self.moves if move.outcome == "pending"]

    def path_of(self, worker: int) -> list[WorkerState]:
        """Every state ``worker`` went through, in order."""
        return [t.state for t in self.history if t.worker == worker and not t.remark]

    def spans(self, until: float) -> list[tuple[int, WorkerState, float, float]]:
        """``(worker, state, start, end)`` for every state a worker was in, up to
        ``until`` for the states they are in now: what a timeline plot draws."""
        changes = [t for t in self.history if not t.remark]
        spans: list[tuple[int, WorkerState, float, float]] = []
        for index, change in enumerate(changes):
            later = (t.at for t in changes[index + 1 :] if t.worker == change.worker)
            spans.append((change.worker, change.state, change.at, next(later, until)))
        return spans

    async def settled(self) -> None:
        """Wait until no move is under way."""
        for move in self.pending():
            await move.finished.wait()

    # ------------------------------------------------------------------ moving

    def borrowable(self, units: int = 1) -> list[Unit]:
        """The hybrid units :meth:`borrow` would move for ``units`` (the most recently
        listed first); never the last serving unit."""
        movable = self._movable("rollout")[-units:] if units > 0 else []
        if movable and not self._others_serve(movable):
            movable = movable[1:]  # the rollout keeps at least one instance
        return movable

    def borrow(self, units: int = 1) -> list[Move]:
        """Start moving up to ``units`` hybrid units from rollout to training."""
        return [self._spawn(unit, "borrow", self._borrow) for unit in self.borrowable(units)]

    def release(self, units: int = 1, *, only: Collection[str] | None = None) -> list[Move]:
        """Start moving up to ``units`` borrowed units back to rollout (of the units
        named in ``only``, when given)."""
        named = [u for u in self._movable("training") if only is None or u.name in only]
        movable = named[-units:] if units > 0 else []
        return [self._spawn(unit, "release", self._release) for unit in movable]

    def apply(self, plan: Plan) -> list[Move]:
        """Move hybrid units towards ``plan.train_workers`` training workers: as many
        whole units as bring training closest without going under the plan when
        borrowing. The plan's TP sizes and buckets are the serving layout it priced;
        units keep their own TP here."""
        missing = plan.train_workers - self.workers_in("training")
        if missing > 0:
            return self.borrow(self._units_for(missing, "rollout"))
        if missing < 0:
            return self.release(self._units_for(-missing, "training", cover=False))
        return []

    def _units_for(self, workers: int, stage: Stage, *, cover: bool = True) -> int:
        """Hybrid units of ``stage`` (from the end) whose workers make ``workers``:
        at least that many with ``cover``, at most that many otherwise."""
        count = total = 0
        for unit in reversed(self._movable(stage)):
            if total >= workers or (not cover and total + len(unit.workers) > workers):
                break
            total += len(unit.workers)
            count += 1
        return count

    def _movable(self, stage: Stage) -> list[Unit]:
        """Hybrid units in ``stage``, neither moving nor lost."""
        return [
            unit
            for unit in self.units
            if unit.role == "hybrid"
            and unit.stage == stage
            and not unit.moving
            and not self.lost(unit)
        ]

    def _others_serve(self, leaving: list[Unit]) -> bool:
        return any(
            u.stage == "rollout" and u not in leaving and not self.lost(u) for u in self.units
        )

    def lost(self, unit: Unit) -> bool:
        """A move of ``unit`` failed and so did its way back: the pool leaves it alone."""
        return any(self.state[worker] == "lost" for worker in unit.workers)

    def _spawn(
        self, unit: Unit, direction: Direction, run: Callable[[Unit], Coroutine[Any, Any, None]]
    ) -> Move:
        if self._group is None:
            raise RuntimeError("enter the pool (async with) before moving workers")
        move = Move(unit.name, direction, anyio.current_time())
        self.moves.append(move)
        unit.moving = True
        unit.stage = "training" if direction == "borrow" else "rollout"
        self._group.start_soon(self._run_move, unit, move, run)
        return move

    async def _run_move(
        self, unit: Unit, move: Move, run: Callable[[Unit], Coroutine[Any, Any, None]]
    ) -> None:
        try:
            await run(unit)
            move.outcome = "done"
        except MoveFailed as error:
            move.error = str(error)
            move.outcome = "lost" if self.lost(unit) else "returned"
        except Exception as error:  # a move never takes the rollout or the training down
            move.error = f"unexpected: {_say(error)}"
            move.outcome = "lost"
            self._set(unit, "lost", move.error)
        finally:
            unit.moving = False
            move.ended = anyio.current_time()
            move.finished.set()

    # ------------------------------------------------------------ borrowing

    async def _borrow(self, unit: Unit) -> None:
        await self._leave_rollout(unit)
        try:
            await self._join(unit)
        except Exception as error:
            await self._back_to_rollout(unit, f"join failed: {_say(error)}")
            raise MoveFailed(f"{unit.name} could not join training: {_say(error)}") from error

    async def _leave_rollout(self, unit: Unit) -> None:
        """Drain, remove and stop the unit's instance: nothing in flight is lost (what
        outlives the drain timeout is cut, and the engine retries it elsewhere)."""
        name = unit.name
        self._set(unit, "draining")
        drained = self.router.drain(name)
        with anyio.move_on_after(self.config.drain_timeout_s) as waited:
            await drained.wait()
        if name in self.router.by_name:  # unless a health check took it out already
            self.router.remove(name, force=True)
        note = "drain timed out: calls cut" if waited.cancelled_caught else ""
        self._set(unit, "stopping", note)
        try:
            with anyio.fail_after(self.config.stop_timeout_s):
                await self.cluster.stop_instance(name)
        except Exception as error:
            # Its workers' state is unknown: try the way back (a fresh start) at once.
            await self._back_to_rollout(unit, f"stop failed: {_say(error)}")
            raise MoveFailed(f"{name} did not stop: {_say(error)}") from error

    async def _join(self, unit: Unit) -> None:
        self._set(unit, "requested")
        config = self.config
        phases: tuple[
            tuple[WorkerState, float, Callable[[int], Coroutine[Any, Any, None]]], ...
        ] = (
            ("fetching_state", config.fetch_timeout_s, self.cluster.fetch_state),
            ("zero_sync", config.zero_sync_timeout_s, self.cluster.zero_sync),
            ("activating", config.activate_timeout_s, self.cluster.activate),
        )
        for state, timeout_s, operation in phases:
            self._set(unit, state)
            await _each_within(unit.workers, operation, timeout_s, state)
        self._set(unit, "active")

    async def _back_to_rollout(self, unit: Unit, why: str) -> None:
        unit.stage = "rollout"
        await self._leave_training(unit, why)
        try:
            await self._serve(unit)
        except MoveFailed as error:
            self._set(unit, "lost", str(error))
            raise

    # ------------------------------------------------------------ releasing

    async def _release(self, unit: Unit) -> None:
        await self._leave_training(unit, "")
        try:
            await self._serve(unit)
        except MoveFailed:
            unit.stage = "training"
            try:
                await self._join(unit)
            except Exception as again:
                self._set(unit, "lost", f"rejoin failed: {_say(again)}")
                raise MoveFailed(f"{unit.name} lost: {_say(again)}") from again
            raise

    async def _leave_training(self, unit: Unit, why: str) -> None:
        """Its workers stop training; a worker that never joined leaves harmlessly."""
        self._set(unit, "leaving", why)
        try:
            await _each_within(
                unit.workers, self.cluster.leave_training, self.config.leave_timeout_s, "leave"
            )
        except Exception as error:  # it trains no more either way: its share is gone
            self._note(unit, f"leave failed: {_say(error)}")

    async def _serve(self, unit: Unit) -> None:
        """Start the unit's instance (a few tries) and add it to the router."""
        config, name = self.config, unit.name
        failure = ""
        for attempt in range(1, config.start_attempts + 1):
            self._set(unit, "starting", f"try {attempt}" if attempt > 1 else "")
            try:
                with anyio.fail_after(config.start_timeout_s):
                    url = await self.cluster.start_instance(name, unit.workers)
            except Exception as error:
                failure = _say(error)
                self._note(unit, f"start failed: {failure}")
                continue
            version = self._weight_version()  # it loaded the weights the others serve
            added = self.router.add_instance(self._spec(unit, url), self._bucket_for(unit))
            added.endpoint.weight_version = version
            self._set(unit, "serving")
            return
        raise MoveFailed(f"{name} did not start in {config.start_attempts} tries: {failure}")

    def _spec(self, unit: Unit, url: str) -> InstanceSpec:
        config = self.config
        return InstanceSpec(
            name=unit.name,
            url=url,
            model=config.model,
            api=config.api,
            tp=len(unit.workers),
            max_num_seqs=config.max_num_seqs,
            kv_capacity_tokens=config.kv_capacity_tokens,
        )

    def _weight_version(self) -> int:
        """The weights the fleet serves now: the newest any instance has."""
        versions = [endpoint.weight_version for endpoint in self.router.endpoints().values()]
        return max(versions, default=0)

    def _bucket_for(self, unit: Unit) -> str:
        for wanted in (unit.bucket, self.config.bucket):
            if wanted and wanted in self.router.bucket_of:
                unit.bucket = wanted
                return wanted
        unit.bucket = self.router.buckets[-1].name
        return unit.bucket

    # ------------------------------------------------------------ bookkeeping

    def _set(self, unit: Unit, state: WorkerState, note: str = "") -> None:
        now = _now()
        for worker in unit.workers:
            self.state[worker] = state
            self.history.append(Transition(now, worker, state, note))

    def _note(self, unit: Unit, note: str) -> None:
        for worker in unit.workers:
            self.history.append(Transition(_now(), worker, self.state[worker], note, True))


async def _each_within(
    workers: Sequence[int],
    operation: Callable[[int], Coroutine[Any, Any, None]],
    timeout_s: float,
    what: str,
) -> None:
    """``operation`` on every worker at once, all done within ``timeout_s``."""
    try:
        with anyio.fail_after(timeout_s):
            async with anyio.create_task_group() as group:
                for worker in workers:
                    group.start_soon(operation, worker)
    except TimeoutError as error:
        raise MoveFailed(f"{what} took over {timeout_s:g} s") from error


def _say(error: BaseException) -> str:
    if isinstance(error, BaseExceptionGroup):
        return "; ".join(_say(inner) for inner in error.exceptions)
    return f"{type(error).__name__}: {error}"


def _now() -> float:
    try:
        return anyio.current_time()
    except RuntimeError:
        return math.nan  # built outside an event loop: the layout's own entries
