"""Lending the rollout's long tail to training, inside a step.

Late in a rollout only a few trajectories are left: most serving instances sit idle while
training (on the previous step's batch) still runs. :func:`lend_tail` watches what the run
observes, the trajectories not finished yet, the calls in flight in the router and how long
training ran last time, and borrows hybrid units from the pool whenever fewer instances
would do for what is left and the borrow pays for itself; the borrowed workers join the
training step under way. They go back when the next step's rollout starts (each release
restarts an instance while that rollout runs on the others), so a borrow pays when the
training seconds it saves exceed the rollout seconds the restart costs
(:func:`borrow_pays`). It never reads the emulator's truth: only counts a real run has.

:class:`TailLender` is the same rule over a whole run (``libra train``'s ``[alloc.tail]``):
it lends inside each step's training and gives the units back when the next rollout
starts.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import anyio
from pydantic import Field, NonNegativeFloat, PositiveFloat

from libra.alloc._moves import Move
from libra.alloc._pool import HybridPool
from libra.config import Section

#: The states in which a worker takes pieces of the step under way.
_TRAINING = ("active", "leaving")


class TailRule(Section):
    """When the tail is idle enough to lend instances to training."""

    trajectories_per_instance: PositiveFloat = Field(
        4.0,
        description="serving instances kept: the unfinished trajectories over this, rounded up",
    )
    max_pressure: float = Field(
        0.5, gt=0, description="calls in flight per batch slot at which nothing is borrowed"
    )
    min_train_left_s: NonNegativeFloat = Field(
        60.0,
        description="training expected to run at least this much longer, or nothing moves: "
        "a borrowed unit costs an instance restart later",
    )
    restart_s: NonNegativeFloat = Field(
        90.0,
        description="seconds a released unit takes to serve again, until the pool has "
        "timed a release of its own: what a borrow costs the next rollout",
    )
    poll_s: PositiveFloat = Field(5.0, description="seconds between two looks")


def serving_units(pool: HybridPool) -> int:
    """Instances serving now, not draining and not lost."""
    return sum(1 for unit in pool.units if unit.stage == "rollout" and not pool.lost(unit))


def pressure(pool: HybridPool) -> float:
    """Calls in flight per batch slot of the active instances."""
    serving = [i for i in pool.router.instances if i.state == "active"]
    slots = sum(instance.capacity for instance in serving)
    return sum(instance.in_flight for instance in serving) / slots if slots else math.inf


def borrow_pays(
    train_left_s: float, training: int, lent: int, serving: int, restart_s: float
) -> bool:
    """Whether ``lent`` more workers joining ``training`` ones save more training seconds
    (it scales with its workers) than the next rollout loses while they restart
    (it runs without them for ``restart_s``, its throughput in proportion to its
    ``serving`` workers)."""
    saved = train_left_s * lent / (training + lent)
    lost = restart_s * lent / max(1, serving)
    return saved > lost


def timed_restart_s(pool: HybridPool, rule: TailRule) -> float:
    """Seconds a release took on this pool, the latest timed; else the rule's prior."""
    for move in reversed(pool.moves):
        if move.direction == "release" and move.outcome == "done" and move.ended is not None:
            return move.ended - move.started
    return rule.restart_s


def tail_borrow(pool: HybridPool, rule: TailRule, unfinished: int, train_left_s: float) -> int:
    """Hybrid units to borrow now, given ``unfinished`` trajectories and the seconds
    training is expected to run still: as many as the tail leaves idle, fewer while the
    borrow would not pay."""
    if train_left_s < rule.min_train_left_s or pressure(pool) >= rule.max_pressure:
        return 0
    needed = max(1, math.ceil(unfinished / rule.trajectories_per_instance))
    count = max(0, serving_units(pool) - needed)
    serving, training = pool.workers_in("rollout"), pool.workers_in("training")
    restart = timed_restart_s(pool, rule)
    while count:
        lent = sum(len(unit.workers) for unit in pool.borrowable(count))
        if borrow_pays(train_left_s, training, lent, serving, restart):
            break
        count -= 1
    return count


async def lend_tail(
    pool: HybridPool,
    rule: TailRule,
    unfinished: Callable[[], int],
    train_left_s: Callable[[], float],
    training_done: anyio.Event,
) -> None:
    """Borrow idle hybrid units while training runs (the pool's moves pay every cost).
    The borrowed units stay on the training side: the next rollout releases them when it
    starts, so that their restarts overlap its work rather than hold this step back."""
    while not training_done.is_set():
        count = tail_borrow(pool, rule, unfinished(), train_left_s())
        if count:
            pool.borrow(count)
        with anyio.move_on_after(rule.poll_s):
            await training_done.wait()


@dataclass
class TailLender:
    """:func:`lend_tail` over a run's steps: ``lending`` wraps each step's training, and
    ``give_back`` returns the units it lent when the next rollout starts."""

    pool: HybridPool
    rule: TailRule
    #: Units the tail lent and has not given back yet, by name.
    lent: list[str] = field(default_factory=list)
    #: The units lent inside the last step's training.
    last: list[str] = field(default_factory=list)
    #: The last step's training: the workers that trained it and stayed, and the
    #: worker-seconds the others put in (units lent inside it, or released as it started).
    _staying: int = field(default=1, init=False, repr=False)
    _helped_worker_s: float = field(default=0.0, init=False, repr=False)
    #: The last step's training seconds per input position, priced alone.
    _rate: float | None = field(default=None, init=False, repr=False)

    @asynccontextmanager
    async def training(
        self, positions: Callable[[], int], unfinished: Callable[[], int]
    ) -> AsyncIterator[None]:
        """Wraps one step's training of ``positions()`` input positions. From the second
        step on, idle units join it (:meth:`lending`), what it has left priced at the
        last step's seconds per position on the workers that started it (the prompts
        and tool returns cost a pass as the sampled tokens do); then this step is
        priced for the next (:meth:`alone_s`)."""
        started, rate = anyio.current_time(), self._rate
        if rate is None:
            yield
        else:

            def left_s() -> float:
                return rate * positions() - (anyio.current_time() - started)

            async with self.lending(unfinished, left_s):
                yield
        train_s = anyio.current_time() - started
        self._rate = self.alone_s(train_s) / max(1, positions())

    @asynccontextmanager
    async def lending(
        self, unfinished: Callable[[], int], train_left_s: Callable[[], float]
    ) -> AsyncIterator[None]:
        """Lend idle hybrid units to the training that runs in the body."""
        first = len(self.pool.moves)
        started = anyio.current_time()
        self._staying, leaving = self._training_now()
        done = anyio.Event()
        try:
            async with anyio.create_task_group() as group:
                group.start_soon(lend_tail, self.pool, self.rule, unfinished, train_left_s, done)
                try:
                    yield
                finally:
                    done.set()
        finally:
            borrows = [m for m in self.pool.moves[first:] if m.direction == "borrow"]
            self.last = [m.unit for m in borrows]
            self.lent += self.last
            ended = anyio.current_time()
            self._helped_worker_s = self._joined_s(borrows, ended) + sum(
                self._left_at(worker, started, ended) - started for worker in leaving
            )

    def _training_now(self) -> tuple[int, list[int]]:
        """Workers training as a step starts: how many stay, and those a pending release
        takes out (in one-step-off they may train pieces of this step first)."""
        releasing = {m.unit for m in self.pool.pending() if m.direction == "release"}
        staying, leaving = 0, list[int]()
        for unit in self.pool.units:
            if all(self.pool.state[w] in _TRAINING for w in unit.workers):
                if unit.name in releasing:
                    leaving += unit.workers
                else:
                    staying += len(unit.workers)
        return max(1, staying), leaving

    def _joined_s(self, borrows: list[Move], ended: float) -> float:
        """Worker-seconds the units of ``borrows`` trained, from their joins to ``ended``."""
        workers = {unit.name: len(unit.workers) for unit in self.pool.units}
        return sum(
            workers[m.unit] * (ended - m.ended)
            for m in borrows
            if m.outcome == "done" and m.ended is not None and m.ended < ended
        )

    def _left_at(self, worker: int, started: float, ended: float) -> float:
        """When ``worker`` stopped training after ``started``, or ``ended``."""
        left = (
            change.at
            for change in self.pool.history
            if change.worker == worker and change.at >= started and not change.remark
            and change.state not in _TRAINING
        )  # fmt: skip
        return min(next(left, ended), ended)

    def alone_s(self, train_s: float) -> float:
        """The last step's ``train_s`` seconds of training as the workers that trained it
        and stay would have taken it alone: what prices the next step's
        (:func:`borrow_pays` scales training with its workers too). Priced at what a
        helped step took, the next step would look shorter than it runs, and its tail
        too short to lend to."""
        return train_s + self._helped_worker_s / self._staying

    def give_back(self) -> list[Move]:
        """Release the lent units that reached training. One still on its way is given
        back at the next call (it trains meanwhile); one whose borrow failed is serving."""
        latest = {move.unit: move for move in self.pool.moves}
        borrowed = [u for u in self.lent if latest[u].direction == "borrow"]
        done = [u for u in borrowed if latest[u].outcome == "done"]
        self.lent = [u for u in borrowed if latest[u].outcome == "pending"]
        return self.pool.release(len(done), only=done) if done else []
