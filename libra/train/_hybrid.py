"""The hybrid gradient group: workers lent to training join it as data-parallel replicas
beside the core trainer's FSDP world, which is never rebuilt for them.

A *replica* is a one-rank trainer world on a hybrid worker: it loads the model folder
while the core world trains (``fetching_state``). At a step boundary the core ranks and
every replica open a gloo group of their own, the *bridge* (:class:`OpenBridge`), and
one exchange in which every member contributes a gradient of zeros proves it whole,
after which the core sends the replicas its current parameters (:class:`SyncBridge`:
``zero_sync``). From then on every bridged step (:class:`BridgedStep`, which the
``Train`` command uses) runs:

1. each participant (a core rank, or an *active* replica) does forward and backward on
   its share of the batch; the core's FSDP reduction averages over the core ranks;
2. every bridge member contributes its world's whole gradient divided by the number of
   participants (a replica that has joined but is not active yet contributes zeros), and
   one all-reduce sums them: every member then holds the batch's gradient;
3. the core ranks take their shards of it, clip and step their optimizer (only the core
   holds optimizer state), then send the new parameters to the replicas.

So a replica's parameters are always the core's, a replica holds no optimizer state, and
a replica that leaves (or dies) takes nothing with it: the bridge is opened again without
it at the next step boundary. A bridge that fails mid-step makes the core skip that
optimizer step on every core rank (they agree over their own world first), and its
caller runs the step again without the failed replica.

Each process holds its place in the bridge in this module (:data:`_bridge`): the trainer
processes run one command at a time, so there is one bridge per process at most.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

import anyio

from libra.train._fsdp import _full
from libra.train._worker import (
    Train,
    TrainerCommand,
    TrainerError,
    TrainerWorld,
    TrainResult,
    combine_loss_metrics,
)

if TYPE_CHECKING:
    import torch
    from torch import nn

    from libra.train._fsdp import FSDPTrainer


class BridgeBroken(RuntimeError):
    """A collective over the bridge failed: a replica died, or did not answer in time."""


@dataclass(slots=True)
class _Bridge:
    group: Any  # torch.distributed.ProcessGroupGloo
    store: Any  # the rendezvous store; bridge rank 0 serves it, so it lives as long
    rank: int
    size: int
    core: bool  # a core-training rank: it steps the optimizer and sends parameters


_bridge: _Bridge | None = None

# How long the bridge's members wait for each other to open it: every member is a live
# process told to come at once, so a member missing after this is dead or hung (the
# collectives' own timeout is longer: there the members wait for each other's backward).
_MEET_S = 30.0


def current() -> _Bridge | None:
    """This process's place in the bridge, if it is in one."""
    return _bridge


# ----------------------------------------------------------------------- commands


@dataclass(frozen=True, slots=True)
class BridgeAddress:
    """Where the next bridge meets: core rank 0's host (as its world reaches it) and a
    port free there. Run on the core world."""

    def run(self, trainer: FSDPTrainer) -> tuple[str, int]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind(("", 0))
            port: int = probe.getsockname()[1]
        return os.environ.get("MASTER_ADDR", "127.0.0.1"), port


@dataclass(frozen=True, slots=True)
class OpenBridge:
    """Leave any bridge and join this one as bridge ranks ``first`` .. ``first`` + the
    world's size - 1 of ``size``. Returns None, or why it failed (a core rank never
    raises here: its world would end with it)."""

    host: str
    port: int
    first: int
    size: int
    core: bool
    timeout_s: float

    def run(self, trainer: FSDPTrainer) -> str | None:
        import torch.distributed as dist

        global _bridge
        _bridge = None
        rank = self.first + trainer.dist.rank
        meet = datetime.timedelta(seconds=min(_MEET_S, self.timeout_s))
        try:
            store = dist.TCPStore(
                self.host, self.port, self.size, is_master=rank == 0, timeout=meet
            )
            group = dist.ProcessGroupGloo(
                dist.PrefixStore("libra-bridge", store),
                rank,
                self.size,
                datetime.timedelta(seconds=self.timeout_s),
            )
        except Exception as error:  # reported to the caller, who drops the replica
            if not self.core:
                raise
            return f"bridge rank {rank}: {error}"
        _bridge = _Bridge(group, store, rank, self.size, self.core)
        return None


@dataclass(frozen=True, slots=True)
class CloseBridge:
    """Leave the bridge (the core, when no replica is left)."""

    def run(self, trainer: FSDPTrainer) -> None:
        global _bridge
        _bridge = None


@dataclass(frozen=True, slots=True)
class SyncBridge:
    """Run on every bridge member: one all-reduce of gradient-shaped zeros proves the
    group whole, then the core's parameters reach every replica. Returns the core's step
    count, or raises :class:`BridgeBroken` (on a core rank: returns -1 instead)."""

    def run(self, trainer: FSDPTrainer) -> int:
        bridge = _in_bridge()
        try:
            summed = _all_reduce(bridge, _flat_zeros(trainer.model))
            if bool(summed.any()):
                raise BridgeBroken("the bridge's zero gradients did not sum to zero")
            send_parameters(bridge, trainer.model)
            steps = _broadcast_steps(bridge, trainer.steps_done)
        except BridgeBroken:
            if not bridge.core:
                raise
            return -1
        trainer.steps_done = steps
        return steps


# ------------------------------------------------------------------ the exchange


@dataclass(slots=True)
class BridgedStep:
    """One optimizer step's exchange over the bridge, for ``participants`` sharing the
    batch (what :meth:`FSDPTrainer.step` calls between backward and the optimizer).
    ``broken``: the bridge failed during it (on a core rank: the step's caller drops
    the replicas; the core stepped only if the gradients were all in)."""

    participants: int
    broken: bool = False

    @property
    def core(self) -> bool:
        return _in_bridge().core

    def reduce_gradients(self, model: nn.Module) -> bool:
        """Make every core rank's gradient shard the batch's (collective over the bridge
        and the core's world). False, on every core rank alike, if the bridge failed."""
        import torch
        import torch.distributed as dist

        bridge = _in_bridge()
        params = [p for p in model.parameters()]
        whole = [_full(p.grad) if p.grad is not None else torch.zeros(p.shape) for p in params]
        flat = torch.cat([g.detach().reshape(-1).float().cpu() for g in whole])
        try:
            flat = _all_reduce(bridge, flat / self.participants)
            ok = True
        except BridgeBroken:
            if not bridge.core:
                raise
            ok = False
        if not bridge.core:
            return ok
        # The core ranks step together or not at all.
        agreed = torch.tensor([1 if ok else 0])
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        if not int(agreed):
            self.broken = True
            return False
        for param, value in zip(params, flat.split([p.numel() for p in params]), strict=True):
            _set_local(param.grad, value.view(param.shape))
        return True

    def send_parameters(self, model: nn.Module) -> bool:
        """After the core's optimizer step: the replicas take its parameters. False if
        the bridge failed (the core's step stands; the caller drops the replicas)."""
        bridge = _in_bridge()
        try:
            send_parameters(bridge, model)
        except BridgeBroken:
            if not bridge.core:
                raise
            self.broken = True
            return False
        return True


def send_parameters(bridge: _Bridge, model: nn.Module) -> None:
    """Bridge rank 0 (core rank 0) broadcasts every parameter's whole value; the
    replicas copy it into theirs (collective over the bridge and the core's world)."""
    import torch

    params = [p for p in model.parameters()]
    if bridge.core:
        flat = torch.cat([_full(p.detach()).reshape(-1).float().cpu() for p in params])
    else:
        flat = torch.empty(sum(p.numel() for p in params))
    _broadcast(bridge, flat)
    if not bridge.core:
        with torch.no_grad():
            for param, value in zip(params, flat.split([p.numel() for p in params]), strict=True):
                _set_local(param, value.view(param.shape))


# -------------------------------------------------------------------- internals


def _in_bridge() -> _Bridge:
    if _bridge is None:
        raise RuntimeError("this trainer process is in no bridge")
    return _bridge


def _all_reduce(bridge: _Bridge, flat: torch.Tensor) -> torch.Tensor:
    try:
        bridge.group.allreduce([flat]).wait()
    except Exception as error:
        raise BridgeBroken(f"the bridge's all-reduce failed: {error}") from error
    return flat


def _broadcast(bridge: _Bridge, flat: torch.Tensor) -> None:
    import torch.distributed as dist

    options = dist.BroadcastOptions()
    options.rootRank = 0
    try:
        bridge.group.broadcast([flat], options).wait()
    except Exception as error:
        raise BridgeBroken(f"the bridge's broadcast failed: {error}") from error


def _broadcast_steps(bridge: _Bridge, steps: int) -> int:
    import torch

    count = torch.tensor([float(steps)])
    _broadcast(bridge, count)
    return int(count)


def _flat_zeros(model: nn.Module) -> torch.Tensor:
    import torch

    return torch.zeros(sum(p.numel() for p in model.parameters()))


def _set_local(target: Any, whole: torch.Tensor) -> None:
    """Copy this rank's part of ``whole`` into ``target`` (a DTensor's local shard, or a
    plain tensor), in place."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(target, DTensor):
        mine = distribute_tensor(
            whole.to(target.device), target.device_mesh, target.placements, src_data_rank=None
        )
        target.to_local().copy_(mine.to_local())
    else:
        target.copy_(whole)


# ---------------------------------------------------------------- the loop's side


ReplicaState = Literal["fetching", "fetched", "synced", "active"]


@dataclass(slots=True)
class Replica:
    """A hybrid worker's one-rank world: ``fetching`` (loading the model folder),
    ``fetched``, ``synced`` (in the bridge, contributing zeros), ``active`` (taking a
    share of every batch)."""

    worker: int
    world: TrainerWorld
    state: ReplicaState = "fetching"
    fetch_s: float = 0.0


class HybridGroup:
    """The replicas of the hybrid gradient group, driven beside the core's world (the
    :class:`~libra.train._elastic.ElasticTrainer` owns one and calls every method but
    :meth:`fetch` at a step boundary, under its lock). ``start`` starts a one-rank world
    on a worker; ``timeout_s`` bounds the bridge's rendezvous and each collective."""

    def __init__(self, start: Callable[[int], TrainerWorld], timeout_s: float) -> None:
        self._start, self.timeout_s = start, timeout_s
        self.replicas: dict[int, Replica] = {}
        self._open = False  # whether the core is in a bridge
        #: Replicas dropped because they failed, and why, in order.
        self.failures: list[tuple[int, str]] = []

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
        started = time.perf_counter()
        replica = self.replicas[worker] = Replica(worker, self._start(worker))
        try:
            await replica.world.__aenter__()
            await replica.world.ready()
        except BaseException:
            await self._stop(worker)
            raise
        replica.state, replica.fetch_s = "fetched", time.perf_counter() - started

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

    def activate(self, worker: int) -> None:
        replica = self.replicas.get(worker)
        if replica is None or replica.state not in ("synced", "active"):
            raise RuntimeError(f"worker {worker} is not in the trainer's hybrid gradient group")
        replica.state = "active"

    async def drop(self, core: TrainerWorld, worker: int) -> None:
        """Stop ``worker``'s replica; the bridge goes on without it."""
        replica = self.replicas.get(worker)
        if replica is None:
            return
        bridged = replica.state in ("synced", "active")
        await self._stop(worker)
        if bridged:
            await self._reopen(core)

    async def train(
        self, core: TrainerWorld, make: Callable[[int], TrainerCommand[Any] | None]
    ) -> Any:
        """One step over the core and the bridge, the batch ``make`` builds split over the
        core's ranks and the active replicas; run again without any replica that fails.
        (Any other command ``make`` builds runs on the core alone.)"""
        while True:
            active = self.active
            command = make(core.world_size + len(active))
            if command is None:
                return None
            if not self.bridged or not isinstance(command, Train):
                return await core.call(command)
            first = {w: core.world_size + i for i, w in enumerate(active)} | {None: 0}
            shares = {
                key: replace(command, first_rank=first.get(key), bridged=True)
                for key in self._keys()
            }
            failed = len(self.failures)
            results = await self._on_bridge(core, shares)
            outcome: TrainResult = results[None]
            if not outcome.broken:
                return _combined(outcome, core.world_size, [results[w] for w in active])
            if len(self.failures) == failed:  # no replica says why: none is trusted
                for replica in self.bridged:
                    self.failures.append((replica.worker, "the bridge broke mid-step"))
                    await self._stop(replica.worker)
            await self._reopen(core)
            if outcome.stepped:
                return outcome  # every share was in; the core's step stands

    async def close(self) -> None:
        for worker in list(self.replicas):
            await self._stop(worker)

    async def reopen(self, core: TrainerWorld) -> None:
        """Open the bridge again (a new core world, after a resize)."""
        self._open = False
        await self._reopen(core)

    # -------------------------------------------------------------- internals

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

        failed: TrainerError | None = None
        async with anyio.create_task_group() as group:
            for replica in members:
                group.start_soon(run, replica)
            try:
                results[None] = await core.call(commands[None])
            except TrainerError as error:
                failed = error
                group.cancel_scope.cancel()  # the replicas would wait for the core in vain
        if failed is not None:
            raise failed
        for replica in members:
            if replica.worker not in results:
                await self._stop(replica.worker)
        return results

    async def _stop(self, worker: int) -> None:
        replica = self.replicas.pop(worker, None)
        if replica is not None:
            with anyio.CancelScope(shield=True), contextlib.suppress(TrainerError):
                await replica.world.__aexit__(None, None, None)

    def _why(self, worker: int) -> str:
        return next((why for w, why in reversed(self.failures) if w == worker), "unknown")


def _combined(core: TrainResult, core_ranks: int, replicas: Sequence[TrainResult]) -> TrainResult:
    """The step as one world's: the loss is the batch's (each world's is its
    participants' sum, scaled as ``Train`` scales it), the norm and rate the core's."""
    participants = core_ranks + len(replicas)
    loss = (core.step.loss * core_ranks + sum(r.step.loss for r in replicas)) / participants
    step = replace(core.step, loss=loss)
    parts = [core.loss, *(r.loss for r in replicas)]
    return TrainResult(step, combine_loss_metrics([p for p in parts if p]))
