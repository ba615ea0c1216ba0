"""An elastic trainer: its world of FSDP ranks grows and shrinks between optimizer steps,
and the run's parameters and optimizer state go on exactly.

Each rank is one *worker* (a set of CPU cores here, an accelerator elsewhere), pinned to
its cores. A world change is a restart at a step boundary, in two halves:

1. :meth:`ElasticTrainer.prepare` starts the next world's ranks (a fresh process group on
   a fresh rendezvous port): they load the model folder while the current ranks go on
   training, so fetching the model costs the run nothing;
2. :meth:`ElasticTrainer.switch` waits for the current command to end (the step
   boundary), has the current ranks write their sharded parameters, optimizer state, LR
   schedule and step count with ``torch.distributed.checkpoint`` to a scratch folder, and
   the next world's ranks read them back resharded for their world size; then one
   gradient-shaped all-reduce in which every rank contributes zeros proves the new group
   in step (:class:`ZeroSync`), and the old ranks exit. The next command runs on the new
   world: a batch is split over :attr:`ElasticTrainer.world_size` ranks.

That rebuilds the core's world. Hybrid workers lent to training do not: they join the
:class:`~libra.workers._hybrid.HybridGroup` as one-rank replicas beside the core's world
(:meth:`ElasticTrainer.fetch_replica`, :meth:`~ElasticTrainer.sync_replica`,
:meth:`~ElasticTrainer.activate_replica`, :meth:`~ElasticTrainer.drop_replica`), even
during a step, which is then taken in pieces over the core and the replicas.
"""

from __future__ import annotations

import contextlib
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Self, TypeVar

import anyio

from libra.trainer import (
    Train,
    TrainerCommand,
    TrainerConfig,
    TrainerError,
    TrainerProcess,
    TrainerWorld,
    load_trainer_state,
    save_trainer_state,
)
from libra.workers._hybrid import HybridGroup

if TYPE_CHECKING:
    from libra.trainer import FSDPTrainer

T = TypeVar("T")

WorldFactory = Callable[[tuple[int, ...]], TrainerWorld]
"""How a world of ranks on these workers (worker ids, rank order) is started: processes
here by default, Ray actors with the Ray backend (``libra.workers._ray``)."""


# ------------------------------------------------------------------------ commands


@dataclass(frozen=True, slots=True)
class SaveState:
    """Write the trainer's whole state (sharded) under ``folder``."""

    folder: Path

    def run(self, trainer: FSDPTrainer) -> None:
        import torch.distributed as dist

        save_trainer_state(trainer, self.folder)
        dist.barrier()  # rank 0 answers once every rank's files are written


@dataclass(frozen=True, slots=True)
class LoadState:
    """Read what :class:`SaveState` wrote, resharded for this world; the step count."""

    folder: Path

    def run(self, trainer: FSDPTrainer) -> int:
        import torch.distributed as dist

        load_trainer_state(trainer, self.folder)
        dist.barrier()  # rank 0 answers once every rank has read: the folder may go
        return trainer.steps_done


@dataclass(frozen=True, slots=True)
class ZeroSync:
    """One all-reduce of gradient-shaped zeros over every rank's parameter shards, and of
    the step counts: the new group is whole and in step. Returns the step count."""

    def run(self, trainer: FSDPTrainer) -> int:
        import torch
        import torch.distributed as dist

        # A reduce-scatter's worth per parameter: the same size on every rank, whatever
        # the uneven shards each holds.
        world = trainer.dist.world_size
        size = sum(-(-p.numel() // world) for p in trainer.model.parameters())
        grads = torch.zeros(max(size, 1), device=trainer.dist.device)
        dist.all_reduce(grads)
        steps = torch.tensor(
            [trainer.steps_done, -trainer.steps_done], dtype=torch.long, device=grads.device
        )
        dist.all_reduce(steps, op=dist.ReduceOp.MAX)
        if bool(grads.any()) or int(steps[0]) != -int(steps[1]):
            raise RuntimeError("the new group is not in step: its ranks disagree")
        return trainer.steps_done


# ------------------------------------------------------------------------ the trainer


@dataclass(frozen=True, slots=True)
class Resize:
    """One world change, as measured: ``prepare_s`` the next world's ranks took to load
    (overlapping training), ``switch_s`` the handover at the step boundary."""

    members: tuple[int, ...]
    prepare_s: float
    switch_s: float


class ElasticTrainer:
    """The trainer's ranks on ``members`` (worker ids, rank order) of ``cores`` (each
    worker's CPU cores); its world changes by :meth:`prepare` then :meth:`switch`::

        async with ElasticTrainer(model_dir, config, cores, members=(0,)) as trainer:
            await trainer.call(Train(batch, grpo, temperature))
            await trainer.prepare((0, 1))  # while training goes on
            await trainer.switch()  # at the next step boundary

    Commands and switches are serialized: a switch waits for the command under way.
    ``worlds`` starts each world (default: :class:`TrainerProcess` ranks pinned to their
    workers' ``cores``); the trainer itself does not know what runs its ranks.
    """

    def __init__(
        self,
        model_dir: Path,
        config: TrainerConfig,
        cores: Mapping[int, tuple[int, ...]] | None = None,
        *,
        members: Sequence[int] = (0,),
        worlds: WorldFactory | None = None,
        bridge_timeout_s: float = 600.0,
        in_pieces: bool = False,
        piece_patience_s: float = 60.0,
    ) -> None:
        """``bridge_timeout_s`` bounds the hybrid gradient group's collectives and each
        piece a replica takes (``piece_patience_s``: a replica's piece is cut sooner once
        the step's pieces say how long one takes); ``in_pieces``: every step is taken in
        pieces, so that a hybrid worker lent while it runs joins it (see ``_hybrid``)."""
        self.model_dir, self.config = model_dir, config
        self.cores = dict(cores) if cores is not None else None
        self._worlds = worlds if worlds is not None else self._local_world
        self._current = self._world(tuple(members))
        self._members = tuple(members)
        self.hybrid = HybridGroup(
            lambda worker: self._world((worker,)),
            bridge_timeout_s,
            in_pieces=in_pieces,
            piece_patience_s=piece_patience_s,
        )
        self._next: tuple[tuple[int, ...], TrainerWorld, float] | None = None
        self._lock = anyio.Lock()
        self._watching: anyio.CancelScope | None = None
        self.resizes: list[Resize] = []

    @property
    def members(self) -> tuple[int, ...]:
        """The core's workers, in rank order."""
        return self._members

    @property
    def training(self) -> tuple[int, ...]:
        """Every worker that takes a share of the batch: the core's, then the active
        replicas'."""
        return self._members + self.hybrid.active

    @property
    def world_size(self) -> int:
        """How many shares a batch is split into."""
        return len(self.training)

    @property
    def preparing(self) -> tuple[int, ...] | None:
        """The members of the world being prepared, if one is."""
        return self._next[0] if self._next is not None else None

    def _world(self, members: tuple[int, ...]) -> TrainerWorld:
        if not members or len(set(members)) != len(members):
            raise ValueError(f"a trainer's world is one or more distinct workers, not {members}")
        return self._worlds(members)

    def _local_world(self, members: tuple[int, ...]) -> TrainerProcess:
        cores = [self.cores[m] for m in members] if self.cores is not None else None
        return TrainerProcess(self.model_dir, self.config, world_size=len(members), cores=cores)

    async def __aenter__(self) -> Self:
        await self._current.__aenter__()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        with anyio.CancelScope(shield=True):
            await self.discard()
            await self.hybrid.close()
            await self._current.__aexit__(exc_type, exc, traceback)

    async def ready(self) -> None:
        await self._current.ready()

    async def call(self, command: TrainerCommand[T]) -> T:
        """Run ``command`` on every rank of the current world; rank 0's result. A
        :class:`Train` runs over the hybrid gradient group too, when it has replicas."""
        train: object = command
        if isinstance(train, Train):
            wanted = train.batch.ranks

            def same(shares: int) -> TrainerCommand[T]:
                if shares != wanted:
                    raise ValueError(f"a batch for {wanted} ranks, but {shares} train")
                return command

            result: T = await self.call_sized(same)  # type: ignore[assignment]
            return result
        async with self._lock:
            return await self._current.call(command)

    async def call_sized(self, make: Callable[[int], TrainerCommand[T] | None]) -> T | None:
        """Run the command ``make`` builds for the shares it will run on (a batch is
        split over :attr:`world_size` ranks): no switch or join comes between the two.
        None: nothing. A :class:`Train` runs over the hybrid gradient group when it has
        replicas (and again without a replica that fails mid-step)."""
        async with self._lock:
            result: T | None = await self.hybrid.train(self._current, make)
            return result

    # ---------------------------------------------------------- hybrid workers

    async def fetch_replica(self, worker: int) -> None:
        """Start ``worker``'s replica and wait until it has loaded the model, while the
        core trains (``fetching_state``)."""
        await self.hybrid.fetch(worker)

    async def sync_replica(self, worker: int) -> int:
        """Take ``worker``'s replica into the hybrid gradient group (``zero_sync``): now,
        between two pieces of the step under way, or at once between steps; the step
        count. It contributes zeros until activated."""
        if self.hybrid.stepping:
            return await self.hybrid.request_sync(worker)
        async with self._lock:
            with anyio.CancelScope(shield=True):  # half a bridge hangs its members
                steps = await self.hybrid.sync(self._current, worker)
        return steps

    async def activate_replica(self, worker: int) -> None:
        """``worker``'s replica takes pieces of the step under way, or of the next."""
        self.hybrid.activate(worker)

    async def drop_replica(self, worker: int) -> None:
        """Stop ``worker``'s replica (at a step boundary if it is in the group)."""
        replica = self.hybrid.replicas.get(worker)
        if replica is not None and replica.state in ("fetching", "fetched"):
            await self.hybrid.drop(self._current, worker)  # not in the bridge: at once
            return
        async with self._lock:
            with anyio.CancelScope(shield=True):
                await self.hybrid.drop(self._current, worker)

    async def watch(self) -> None:
        """As :meth:`TrainerWorld.watch`, following the world through its changes."""
        while True:
            with anyio.CancelScope() as scope:
                self._watching = scope
                await self._current.watch()
            self._watching = None

    # ------------------------------------------------------------------ resizing

    async def prepare(self, members: Sequence[int]) -> None:
        """Start the ranks of a world of ``members`` and wait until they have loaded the
        model; the current world keeps training. A world prepared before is discarded."""
        wanted = tuple(members)
        if self._next is not None and self._next[0] == wanted:
            return
        await self.discard()
        started = time.perf_counter()
        process = self._world(wanted)
        await process.__aenter__()
        self._next = (wanted, process, 0.0)
        try:
            await process.ready()
        except BaseException:
            await self.discard()
            raise
        self._next = (wanted, process, time.perf_counter() - started)

    async def discard(self) -> None:
        """Stop the world being prepared, if any (a join that is called off)."""
        if self._next is not None:
            _, process, _ = self._next
            self._next = None
            with anyio.CancelScope(shield=True):
                await process.__aexit__(None, None, None)

    async def switch(self) -> int:
        """At the next step boundary, move the state to the prepared world and make it
        the current one; the step count it holds. Without a prepared world: an error."""
        if self._next is None:
            raise RuntimeError("no world is prepared to switch to")
        async with self._lock:
            with anyio.CancelScope(shield=True):  # half a handover would lose the state
                steps = await self._hand_over()
        return steps

    async def _hand_over(self) -> int:
        assert self._next is not None
        members, process, prepare_s = self._next
        started = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="libra-elastic-") as scratch:
            await self._current.call(SaveState(Path(scratch)))
            await process.call(LoadState(Path(scratch)))
        steps = await process.call(ZeroSync())
        self._next = None
        old, self._current, self._members = self._current, process, members
        if self._watching is not None:
            self._watching.cancel()  # before the old ranks exit: their end is no death
        with contextlib.suppress(TrainerError):
            await old.__aexit__(None, None, None)
        if self.hybrid.bridged:
            await self.hybrid.reopen(self._current)
        self.resizes.append(Resize(members, prepare_s, time.perf_counter() - started))
        return steps
