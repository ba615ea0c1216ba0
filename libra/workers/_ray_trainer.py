"""The trainer on Ray: one world of FSDP ranks, one :class:`RankActor` each (see ``_ray``)."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable, Sequence
from functools import cache, partial
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self, TypeVar

import anyio

from libra.trainer import TrainerCommand, TrainerError

if TYPE_CHECKING:
    from libra.trainer import FSDPTrainer, TrainerConfig

from libra.workers._ray import import_ray

T = TypeVar("T")

# After a rank's command fails, how long the other ranks' answers are awaited to learn
# whether a rank died (a peer's death makes the survivors' collectives fail).
_DEATH_WAIT_S = 10.0


class RankActor:
    """One FSDP rank in a Ray actor (made remote by :func:`_rank_class`)."""

    def __init__(self, rank: int, world_size: int, cores: tuple[int, ...] | None) -> None:
        self.rank, self.world_size, self.cores = rank, world_size, cores
        self.trainer: FSDPTrainer | None = None
        self.threads = 1
        self._parked = threading.Event()

    def rendezvous(self) -> tuple[str, int]:
        """Rank 0's address and a free port on it: where the process group meets."""
        import ray

        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind(("", 0))
            port: int = probe.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def load(self, where: tuple[str, int], model_dir: Path, config: TrainerConfig) -> None:
        """Join the process group at ``where`` and load the model, sharded."""
        import torch

        from libra.trainer import FSDPTrainer

        address, port = where
        # One accelerator per actor (Ray sets what it sees), so the local rank is 0.
        os.environ.update(
            RANK=str(self.rank),
            WORLD_SIZE=str(self.world_size),
            LOCAL_RANK="0",
            LOCAL_WORLD_SIZE="1",
            MASTER_ADDR=address,
            MASTER_PORT=str(port),
        )
        if self.cores is not None:
            os.sched_setaffinity(0, self.cores)
            config = config.model_copy(update={"cpu_threads": len(self.cores)})
        self.trainer = FSDPTrainer(model_dir, config)
        self.threads = torch.get_num_threads()

    def run(self, command: TrainerCommand[T]) -> T:
        import torch

        assert self.trainer is not None, "load() first"
        # A threaded actor may run each call on another thread than load(): give it the
        # torch threads the trainer chose there (OpenMP's count is per thread).
        torch.set_num_threads(self.threads)
        return command.run(self.trainer)

    def pid(self) -> int:
        return os.getpid()

    def park(self) -> None:
        """Return never: the caller's wait on it ends when the actor dies."""
        self._parked.wait()


@cache
def _rank_class() -> Any:
    # Threaded: ``park`` waits beside the commands (which the world runs one at a time).
    return import_ray().remote(max_concurrency=2)(RankActor)


class _RankEnded(Exception):
    """A rank's call ended in error: ``died`` (its actor is gone), or it raised."""

    def __init__(self, rank: int, *, died: bool, detail: str) -> None:
        super().__init__(rank, died, detail)
        self.rank, self.died, self.detail = rank, died, detail


class RayTrainer:
    """One world of FSDP ranks as Ray actors, rank ``r`` started with ``placements[r]``
    (Ray actor options: its worker's bundle and share) and pinned to ``cores[r]`` when
    given. The interface is :class:`~libra.trainer.TrainerProcess`'s: a rank whose
    actor dies makes :meth:`call` and :meth:`watch` raise ``trainer rank N died ...``."""

    def __init__(
        self,
        model_dir: Path,
        config: TrainerConfig,
        placements: Sequence[dict[str, Any]],
        cores: Sequence[tuple[int, ...]] | None = None,
    ) -> None:
        if cores is not None and len(cores) != len(placements):
            raise ValueError(f"{len(cores)} core sets for {len(placements)} ranks")
        self.model_dir, self.config = model_dir, config
        self.placements = list(placements)
        self.cores = [tuple(c) for c in cores] if cores is not None else None
        self._actors: list[Any] = []
        self._loading: list[Any] = []
        self._parked: list[Any] = []
        self._ended: TrainerError | None = None
        self._died = False
        self._loaded = anyio.Lock()

    @property
    def world_size(self) -> int:
        return len(self.placements)

    async def __aenter__(self) -> Self:
        """Start the actors and have them load (the wait is :meth:`ready`'s)."""
        rank_class = _rank_class()
        for rank, options in enumerate(self.placements):
            mine = self.cores[rank] if self.cores is not None else None
            actor = rank_class.options(**options).remote(rank, self.world_size, mine)
            self._actors.append(actor)
        where = self._actors[0].rendezvous.remote()  # resolved by Ray before each load
        self._loading = [a.load.remote(where, self.model_dir, self.config) for a in self._actors]
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._kill()

    def _kill(self) -> None:
        ray = import_ray()
        for actor in self._actors:
            ray.kill(actor, no_restart=True)

    async def ready(self) -> None:
        """Wait until every rank has joined the group and loaded the model."""
        async with self._loaded:  # watch() and the first call may both wait here
            if self._loading:
                await self._gather(self._loading)
                self._loading = []
                self._parked = [actor.park.remote() for actor in self._actors]

    async def call(self, command: TrainerCommand[T]) -> T:
        """Run ``command`` on every rank; rank 0's result."""
        await self.ready()
        shared = import_ray().put(command)  # sent once, read by every rank
        results = await self._gather([actor.run.remote(shared) for actor in self._actors])
        result: T = results[0]
        return result

    async def call_sized(self, make: Callable[[int], TrainerCommand[T] | None]) -> T | None:
        command = make(self.world_size)
        return None if command is None else await self.call(command)

    async def watch(self) -> None:
        """Return never while the ranks live; raise :class:`TrainerError` as soon as one
        dies. (A rank that raised is :meth:`call`'s to report: the ranks it stopped are
        no death.)"""
        await self.ready()
        rank = await anyio.to_thread.run_sync(self._first_death, abandon_on_cancel=True)
        error = self._end(_RankEnded(rank, died=True, detail="its actor died"))
        if self._died:
            raise error
        await anyio.sleep_forever()

    def _first_death(self) -> int:
        ray = import_ray()
        done, _ = ray.wait(self._parked, num_returns=1)
        return self._parked.index(done[0])

    async def _gather(self, refs: list[Any]) -> list[Any]:
        if self._ended is not None:
            raise self._ended
        try:
            return await anyio.to_thread.run_sync(partial(_wait_all, refs), abandon_on_cancel=True)
        except _RankEnded as ended:
            raise self._end(ended) from None

    def _end(self, ended: _RankEnded) -> TrainerError:
        """The error every later call raises too; the ranks left are stopped (they may be
        waiting in a collective for the one that ended)."""
        if self._ended is None:
            self._died = ended.died
            self._kill()
            how = "died" if ended.died else "failed"
            message = f"trainer rank {ended.rank} {how} ({ended.detail})"
            if not ended.died:
                message = f"the trainer failed: {message}"
            self._ended = TrainerError(message)
        return self._ended


def _wait_all(refs: list[Any]) -> list[Any]:
    """Every rank's answer, in rank order; the first rank to end in error raises
    :class:`_RankEnded` (a death reported before a failure it caused)."""
    ray = import_ray()
    answers: dict[int, Any] = {}
    pending = list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        rank = refs.index(done[0])
        try:
            answers[rank] = ray.get(done[0])
        except ray.exceptions.RayActorError as died:
            raise _RankEnded(rank, died=True, detail=_first_line(died)) from None
        except ray.exceptions.RayTaskError as failed:
            raise _death_among(pending, refs) or _RankEnded(
                rank, died=False, detail=str(failed)
            ) from None
    return [answers[rank] for rank in range(len(refs))]


def _death_among(pending: list[Any], refs: list[Any]) -> _RankEnded | None:
    ray = import_ray()
    done, _ = ray.wait(pending, num_returns=len(pending), timeout=_DEATH_WAIT_S)
    for ref in done:
        try:
            ray.get(ref)
        except ray.exceptions.RayActorError as died:
            return _RankEnded(refs.index(ref), died=True, detail=_first_line(died))
        except ray.exceptions.RayTaskError:
            continue
    return None


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0].rstrip(".") if lines else type(error).__name__
