"""The hybrid gradient group: workers lent to training join it as data-parallel replicas
beside the core trainer's FSDP world, which is never rebuilt for them, and they join the
step under way.

A *replica* is a one-rank trainer world on a hybrid worker: it loads the model folder
while the core trains (``fetching_state``). Then the core's ranks and every replica open
a gloo group of their own, the *bridge* (:class:`OpenBridge`); one exchange in which
every member contributes a gradient of zeros proves it whole, and the core sends the
replicas its parameters (:class:`SyncBridge`: ``zero_sync``).

While the group has replicas (always, in a run with hybrid units: ``in_pieces``) a
step is taken in pieces (:meth:`HybridGroup.train`): the
step's micro-batches wait in one queue, longest first; the core takes one per rank at a
time and every *active* replica one at a time (:class:`Accumulate`), each adding the
gradient to its own. A worker that joins mid-step is let in between two pieces (the
bridge opened again, its parameters synced: they do not change until the step's end)
and takes pieces from the same queue: it joins the step under way. When the queue is
empty every member contributes its world's gradient to one all-reduce over the bridge
(:class:`FinishStep`); the core ranks take their shards of the sum, clip and step their
optimizer (only the core holds optimizer state), then send the replicas the new
parameters. So a replica holds nothing the run needs: one that dies mid-step is
dropped and the pieces it had done go back in the queue; one whose bridge fails at the
exchange costs the step, which is taken again without it.

The commands the trainer processes run are in ``_bridge``; this module is the loop's
side.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal, TypeVar

import anyio

from libra.trainer import (
    StepMetrics,
    Train,
    TrainerCommand,
    TrainerError,
    TrainerWorld,
    TrainResult,
    combine_loss_metrics,
)
from libra.workers._bridge import (
    Accumulate,
    BridgeAddress,
    CloseBridge,
    FinishStep,
    OpenBridge,
    SyncBridge,
)

T = TypeVar("T")

#: A replica's piece may take this many times the slowest piece the step has seen (or
#: the group's ``piece_patience_s``, if longer) before the replica counts as hung.
PATIENCE_FACTOR = 10.0

ReplicaState = Literal["fetching", "fetched", "synced", "active"]


@dataclass(slots=True)
class Replica:
    """A hybrid worker's one-rank world: ``fetching`` (loading the model folder),
    ``fetched``, ``synced`` (in the bridge, contributing zeros), ``active`` (taking
    pieces of every step)."""

    worker: int
    world: TrainerWorld
    state: ReplicaState = "fetching"


@dataclass(slots=True)
class _Joining:
    """A worker waiting to be let in between two pieces of the step under way."""

    worker: int
    answered: anyio.Event = field(default_factory=anyio.Event)
    outcome: int | BaseException | None = None


@dataclass(slots=True)
class _Piece:
    """A piece done: by whom (None: the core), which micro-batches, what it measured."""

    by: int | None
    indices: list[int]
    loss: float
    metrics: list[dict[str, float]]


class HybridGroup:
    """The replicas of the hybrid gradient group, driven beside the core's world. The
    :class:`~libra.workers._elastic.ElasticTrainer` owns one: :meth:`fetch` runs while the
    core trains, :meth:`sync` and :meth:`drop` at a step boundary (under the trainer's
    lock) or, through :meth:`request_sync`, between two pieces of the step under way.
    ``start`` starts a one-rank world on a worker; ``timeout_s`` bounds the bridge's
    collectives and each piece a replica takes; once a piece of the step has ended, a
    replica's piece is also cut after ``PATIENCE_FACTOR`` times the slowest one (at
    least ``piece_patience_s``): a hung replica is dropped while the core goes on."""

    def __init__(
        self,
        start: Callable[[int], TrainerWorld],
        timeout_s: float,
        *,
        in_pieces: bool = False,
        piece_patience_s: float = 60.0,
    ) -> None:
        """``in_pieces``: every step is taken in pieces, even with no replica, so that a
        worker lent while it runs joins it (else only steps with replicas are). In pieces
        a core of several ranks reduces each piece's gradient at once, where a whole step
        reduces once, at its last micro-batch."""
        self._start, self.timeout_s, self.in_pieces = start, timeout_s, in_pieces
        self.piece_patience_s = piece_patience_s
        self.replicas: dict[int, Replica] = {}
        #: Micro-batches of the last step, per member (None: the core) when it was taken
        #: in pieces; empty when it trained nothing or not in pieces.
        self.shares: Counter[int | None] = Counter()
        #: Replicas dropped because they failed, and why, in order.
        self.failures: list[tuple[int, str]] = []
        self._open = False  # whether the core is in a bridge
        self._stepping = False  # a step is taken in pieces
        self._joining: list[_Joining] = []
        self._lost: list[int] = []  # replicas that failed a piece: out before the step ends
        self._interrupt = False  # the round of pieces under way ends early

    @property
    def stepping(self) -> bool:
        return self._stepping

    @property
    def bridged(self) -> list[Replica]:
        """The replicas in the bridge, in the order they joined it."""
        return [r for r in self.replicas.values() if r.state in ("synced", "active")]

    @property
    def active(self) -> tuple[int, ...]:
        return tuple(r.worker for r in self.replicas.values() if r.state == "active")

    async def fetch(self, worker: int) -> None:
        """Start ``worker``'s replica and wait until it has loaded the model."""
        if worker in self.replicas:
            return
        replica = self.replicas[worker] = Replica(worker, self._start(worker))
        try:
            await replica.world.__aenter__()
            await replica.world.ready()
        except BaseException:
            await self._stop(worker)
            raise
        replica.state = "fetched"

    async def sync(self, core: TrainerWorld, worker: int) -> int:
        """Open the bridge with ``worker`` in it; one zero exchange, then the core's
        parameters reach it. The core's step count."""
        replica = self.replicas.get(worker)
        if replica is None or replica.state != "fetched":
            state = "none" if replica is None else replica.state
            raise RuntimeError(f"worker {worker} has no replica fetched to sync (it is {state})")
        replica.state = "synced"
        await self._reopen(core)
        if worker in self.replicas:  # else it failed to open the bridge, and was dropped
            results = await self._on_bridge(core, dict.fromkeys(self._keys(), SyncBridge()))
        if worker not in self.replicas:
            raise RuntimeError(f"worker {worker}'s replica failed to join: {self._why(worker)}")
        steps: int = results[None]
        if steps < 0:
            await self._reopen(core)  # those that failed are dropped: the rest are in step
            raise RuntimeError(f"the bridge failed while worker {worker} joined it")
        return steps

    async def request_sync(self, worker: int) -> int:
        """While a step is taken in pieces: :meth:`sync`, as soon as the pieces under
        way are done (the step goes on with ``worker`` in the group)."""
        joining = _Joining(worker)
        self._joining.append(joining)
        self._interrupt = True
        try:
            await joining.answered.wait()
        finally:
            if joining in self._joining:  # called off before its turn
                self._joining.remove(joining)
        if isinstance(joining.outcome, BaseException):
            raise joining.outcome
        assert joining.outcome is not None
        return joining.outcome

    def activate(self, worker: int) -> None:
        """From the next piece (the step under way) or step on, ``worker`` takes pieces."""
        replica = self.replicas.get(worker)
        if replica is None or replica.state not in ("synced", "active"):
            raise RuntimeError(f"worker {worker} is not in the trainer's hybrid gradient group")
        replica.state = "active"
        self._interrupt = self._stepping

    async def drop(self, core: TrainerWorld, worker: int) -> None:
        """Stop ``worker``'s replica; the bridge goes on without it."""
        replica = self.replicas.get(worker)
        if replica is None:
            return
        bridged = replica.state in ("synced", "active")
        await self._stop(worker, failed=False)
        if bridged:
            await self._reopen(core)

    async def train(
        self, core: TrainerWorld, make: Callable[[int], TrainerCommand[Any] | None]
    ) -> Any:
        """The step ``make`` builds (for the core's ranks and the active replicas),
        taken in pieces over the group, and again without a replica that breaks the
        bridge at its end. (Any other command than a :class:`Train`, or a step while the
        group has no replica, runs on the core alone.)"""
        self.shares = Counter()  # a step that trains nothing took no pieces
        while True:
            command = make(core.world_size + len(self.active))
            if command is None:
                return None
            if not (self.bridged or self.in_pieces) or not isinstance(command, Train):
                return await core.call(command)
            self._stepping = True
            try:
                result = await self._in_pieces(core, command)
            finally:
                self._stepping = False
                await self._admit(core)
            if result is not None:
                return result

    async def close(self) -> None:
        for worker in list(self.replicas):
            await self._stop(worker, failed=False)

    async def reopen(self, core: TrainerWorld) -> None:
        """Open the bridge again (a new core world, after a resize)."""
        self._open = False
        await self._reopen(core)

    # ------------------------------------------------------------ a step in pieces

    async def _in_pieces(self, core: TrainerWorld, command: Train) -> TrainResult | None:
        """The step's pieces, then its end; None if the bridge broke before the core
        stepped (every gradient is gone: the step is to be taken again)."""
        started = time.perf_counter()
        micro = command.batch.micro_batches
        queue = deque(sorted(range(len(micro)), key=lambda i: -micro[i].positions))
        done: list[_Piece] = []
        while queue:
            await self._round(core, command, queue, done)
            await self._admit(core)
        self.shares = Counter()
        for piece in done:
            self.shares[piece.by] += len(piece.indices)
        failed = len(self.failures)
        finish = FinishStep(bridged=bool(self.bridged))
        results = await self._on_bridge(core, dict.fromkeys(self._keys(), finish))
        grad_norm, lr, steps, stepped, broken = results[None]
        if broken:
            if len(self.failures) == failed:  # no replica says why: none is trusted
                for replica in self.bridged:
                    self.failures.append((replica.worker, "the bridge broke at a step's end"))
                    await self._stop(replica.worker)
            await self._reopen(core)
            if not stepped:
                return None
        step = StepMetrics(
            step=steps,
            loss=sum(piece.loss for piece in done),
            grad_norm=grad_norm,
            lr=lr,
            micro_batches=len(micro),
            seconds=time.perf_counter() - started,
        )
        return TrainResult(step, combine_loss_metrics([m for p in done for m in p.metrics]))

    async def _round(
        self, core: TrainerWorld, command: Train, queue: deque[int], done: list[_Piece]
    ) -> None:
        """Pieces to the core and every active replica until the queue is empty or a
        worker is to be let in. A replica that fails a piece, or takes too long over it
        (see the class), is out: what it had done goes back in the queue."""
        self._interrupt = False
        micro = command.batch.micro_batches
        patience = _Patience(self.piece_patience_s)

        async def feed(by: int | None, world: TrainerWorld) -> None:
            size = world.world_size
            while queue and not self._interrupt:
                taken = [queue.popleft() for _ in range(min(size, len(queue)))]
                padding = size - len(taken)  # the core's ranks all take part, some for 0
                piece = Accumulate(
                    tuple(micro[i] for i in [*taken, *[taken[0]] * padding]),
                    (1.0,) * len(taken) + (0.0,) * padding,
                    command.grpo,
                    command.temperature,
                )
                try:
                    if by is None:
                        with patience.timing(None):
                            loss, metrics = await world.call(piece)
                    else:
                        with anyio.fail_after(self.timeout_s) as scope, patience.timing(scope):
                            loss, metrics = await world.call(piece)
                except (TrainerError, TimeoutError) as error:
                    if by is None:
                        raise
                    why = str(error) or f"a piece timed out ({patience.why(self.timeout_s)})"
                    self._lose(by, why, taken, queue, done)
                    return
                done.append(_Piece(by, taken, loss, metrics))

        replicas = [partial(feed, w, self.replicas[w].world) for w in self.active]
        await _beside_core(partial(feed, None, core), replicas)

    def _lose(
        self, worker: int, why: str, taken: list[int], queue: deque[int], done: list[_Piece]
    ) -> None:
        self.failures.append((worker, why))
        queue.extendleft(reversed(taken))
        queue.extend(i for piece in done if piece.by == worker for i in piece.indices)
        done[:] = [piece for piece in done if piece.by != worker]
        if worker in self.replicas:
            self.replicas[worker].state = "fetched"  # out of the feeding; stopped next
        self._lost.append(worker)

    async def _admit(self, core: TrainerWorld) -> None:
        """Between two rounds: stop the replicas lost, let in those waiting."""
        if self._lost:
            for worker in self._lost:
                await self._stop(worker)
            self._lost.clear()
            await self._reopen(core)
        while self._joining:
            joining = self._joining.pop(0)
            try:
                joining.outcome = await self.sync(core, joining.worker)
            except RuntimeError as error:
                joining.outcome = error
            joining.answered.set()

    # -------------------------------------------------------------- the bridge

    async def _reopen(self, core: TrainerWorld) -> None:
        """Open a bridge of the core and the bridged replicas, or close it when there is
        none; a replica that fails to join is dropped, and the rest try once more."""
        for _ in range(2):
            members = self.bridged
            if not members:
                if self._open:
                    await core.call(CloseBridge())
                    self._open = False
                return
            host, port = await core.call(BridgeAddress())
            size = core.world_size + len(members)
            first = {r.worker: core.world_size + i for i, r in enumerate(members)} | {None: 0}
            opens = {
                key: OpenBridge(host, port, first[key], size, key is None, self.timeout_s)
                for key in self._keys()
            }
            failed = len(self.failures)
            results = await self._on_bridge(core, opens)
            error = results[None]
            self._open = error is None
            if error is None and len(self.failures) == failed:
                return
            if len(self.failures) == failed:  # the core failed alone: the newest goes
                newest = [r.worker for r in members if r.state == "synced"] or [members[-1].worker]
                for worker in newest:
                    self.failures.append((worker, str(error)))
                    await self._stop(worker)
        for replica in self.bridged:
            self.failures.append((replica.worker, "the bridge would not open"))
            await self._stop(replica.worker)
        await self._reopen(core)

    def _keys(self) -> list[int | None]:
        """The bridge's members as :meth:`_on_bridge` names them: None, the core."""
        return [None, *(r.worker for r in self.bridged)]

    async def _on_bridge(
        self, core: TrainerWorld, commands: Mapping[int | None, TrainerCommand[Any]]
    ) -> dict[int | None, Any]:
        """Run ``commands[worker]`` on every bridged replica and ``commands[None]`` on the
        core, together (they meet in the bridge's collectives). A replica that fails is
        dropped (recorded in :attr:`failures`); the core's failure is raised."""
        results: dict[int | None, Any] = {}
        members = self.bridged

        async def run(replica: Replica) -> None:
            try:
                results[replica.worker] = await replica.world.call(commands[replica.worker])
            except TrainerError as error:
                self.failures.append((replica.worker, str(error)))

        results[None] = await _beside_core(
            partial(core.call, commands[None]), [partial(run, r) for r in members]
        )
        for replica in members:
            if replica.worker not in results:
                await self._stop(replica.worker)
        return results

    async def _stop(self, worker: int, *, failed: bool = True) -> None:
        """Stop ``worker``'s replica: one that failed is not asked, it is ended."""
        replica = self.replicas.pop(worker, None)
        if replica is None:
            return
        error = TrainerError(self._why(worker)) if failed else None
        with anyio.CancelScope(shield=True), contextlib.suppress(TrainerError):
            await replica.world.__aexit__(type(error) if error else None, error, None)

    def _why(self, worker: int) -> str:
        return next((why for w, why in reversed(self.failures) if w == worker), "unknown")


class _Patience:
    """How long a replica's piece may run: the deadline of every piece under way is
    brought in as the round's pieces end (see :data:`PATIENCE_FACTOR`)."""

    def __init__(self, floor_s: float) -> None:
        self.floor_s, self.slowest_s = floor_s, 0.0
        self._running: dict[anyio.CancelScope, float] = {}  # a replica's piece: its start

    def why(self, timeout_s: float) -> str:
        """What cut a piece, given the group's timeout."""
        if self.slowest_s and self.allowed_s() < timeout_s:
            return f"over {self.allowed_s():.0f} s, {PATIENCE_FACTOR:g}x the slowest piece"
        return f"over {timeout_s:.0f} s"

    def allowed_s(self) -> float:
        return max(self.floor_s, PATIENCE_FACTOR * self.slowest_s)

    @contextlib.contextmanager
    def timing(self, scope: anyio.CancelScope | None) -> Iterator[None]:
        """Time a piece (``scope``: a replica's, whose deadline this brings in)."""
        started = anyio.current_time()
        if scope is not None:
            self._running[scope] = started
            self._bring_in()
        try:
            yield
        finally:
            if scope is not None:
                del self._running[scope]
        self.slowest_s = max(self.slowest_s, anyio.current_time() - started)
        self._bring_in()

    def _bring_in(self) -> None:
        if self.slowest_s:  # only a piece that ended says what a piece takes
            for scope, started in self._running.items():
                scope.deadline = min(scope.deadline, started + self.allowed_s())


async def _beside_core(
    core: Callable[[], Awaitable[T]], replicas: Sequence[Callable[[], Coroutine[Any, Any, None]]]
) -> T:
    """Run ``core`` and ``replicas`` together (they meet in the bridge's collectives);
    the core's result. The core's failure stops the replicas (they would wait for it in
    vain) and is raised as it is."""
    failed: TrainerError | None = None
    async with anyio.create_task_group() as group:
        for replica in replicas:
            group.start_soon(replica)
        try:
            result = await core()
        except TrainerError as error:
            failed = error
            group.cancel_scope.cancel()
    if failed is not None:
        raise failed
    return result
