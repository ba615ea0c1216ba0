"""The hybrid gradient group's rank side: the commands a trainer process runs to open,
close and cross the group's *bridge* (a gloo group of the core's ranks and the replicas,
apart from the core's own world), and to take a step in pieces. ``_hybrid`` drives them.

Each trainer process holds its place in the bridge in this module (:data:`_bridge`): a
process runs one command at a time, so it is in one bridge at most.
"""

from __future__ import annotations

import datetime
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from libra.trainer import GRPOConfig, LossMetrics, MicroBatch, full_tensor, grpo_micro_batch_loss

if TYPE_CHECKING:
    import torch
    from torch import nn

    from libra.trainer import FSDPTrainer


class BridgeBroken(RuntimeError):
    """A collective over the bridge failed: a replica died, or did not answer in time."""


@dataclass(slots=True)
class _Bridge:
    group: Any  # torch.distributed.ProcessGroupGloo
    store: Any  # the rendezvous store; bridge rank 0 serves it, so it lives as long
    core: bool  # a core-training rank: it steps the optimizer and sends parameters


_bridge: _Bridge | None = None

# How long the bridge's members wait for each other to open it: every member is a live
# process told to come at once, so a member missing after this is dead or hung (the
# collectives' own timeout is longer: there the members wait for each other's backward).
_MEET_S = 30.0


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
        _bridge = _Bridge(group, store, self.core)
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


# ------------------------------------------------------------- a step in pieces


@dataclass(frozen=True, slots=True)
class Accumulate:
    """One piece of a step: forward and backward ``micro[rank]`` on each rank of this
    world, its loss weighted ``weights[rank]`` (0: padding, where fewer micro-batches
    than ranks are left), the gradient added to the step's. Returns the loss summed over
    the real micro-batches and each one's loss metrics."""

    micro: tuple[MicroBatch, ...]
    weights: tuple[float, ...]
    grpo: GRPOConfig
    temperature: float

    def run(self, trainer: FSDPTrainer) -> tuple[float, list[dict[str, float]]]:
        import torch
        import torch.distributed as dist

        rank, world = trainer.dist.rank, trainer.dist.world_size
        collected: list[LossMetrics] = []
        loss_fn = partial(
            grpo_micro_batch_loss,
            grpo=self.grpo,
            temperature=self.temperature,
            # FSDP averages over the world's ranks: the world's gradient is then the sum.
            scale=self.weights[rank] * world,
            out=collected,
            chunk_tokens=trainer.config.logprob_chunk_tokens,
        )
        loss = trainer.backward(self.micro[rank].to(trainer.dist.device), loss_fn)
        summed = torch.tensor([loss / world], dtype=torch.float64)
        dist.all_reduce(summed)
        mine = [m.as_floats() for m in collected] if self.weights[rank] else []
        gathered: list[list[dict[str, float]]] = [[] for _ in range(world)]
        dist.all_gather_object(gathered, mine)
        return float(summed), [m for part in gathered for m in part]


@dataclass(frozen=True, slots=True)
class FinishStep:
    """The step's end, on every bridge member: the gradients summed over the bridge, the
    core's optimizer step, its parameters sent to the replicas (``bridged`` False: the
    core alone, no replica being left). Returns the gradient norm, the learning rate,
    the step count, whether the core stepped and whether the bridge broke."""

    bridged: bool = True

    def run(self, trainer: FSDPTrainer) -> tuple[float, float, int, bool, bool]:
        exchange = BridgedStep(trainer.dist.world_size) if self.bridged else None
        before = trainer.steps_done
        grad_norm, lr = trainer.apply_gradients(exchange)
        stepped = trainer.steps_done > before
        broken = exchange is not None and exchange.broken
        return grad_norm, lr, trainer.steps_done, stepped, broken


@dataclass(slots=True)
class BridgedStep:
    """The exchange :meth:`FSDPTrainer.apply_gradients` makes over the bridge, for a
    member whose world has ``world`` ranks. ``broken``: the bridge failed during it (the
    core stepped only if the gradients were all in)."""

    world: int
    broken: bool = False

    @property
    def core(self) -> bool:
        return _in_bridge().core

    def reduce_gradients(self, model: nn.Module) -> bool:
        """Make every core rank's gradient shard the group's sum (collective over the
        bridge and the core's world). False, on every core rank alike, if it failed."""
        import torch
        import torch.distributed as dist

        bridge = _in_bridge()
        params = list(model.parameters())
        whole = [
            full_tensor(p.grad) if p.grad is not None else torch.zeros(p.shape) for p in params
        ]
        # Each of a world's ranks holds the world's whole gradient: a share of it each.
        flat = torch.cat([g.detach().reshape(-1).float().cpu() for g in whole]) / self.world
        try:
            flat = _all_reduce(bridge, flat)
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
        for param, value in _unflattened(flat, params):
            _set_local(param.grad, value)
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

    params = list(model.parameters())
    if bridge.core:
        flat = torch.cat([full_tensor(p.detach()).reshape(-1).float().cpu() for p in params])
    else:
        flat = torch.empty(sum(p.numel() for p in params))
    _broadcast(bridge, flat)
    if not bridge.core:
        with torch.no_grad():
            for param, value in _unflattened(flat, params):
                _set_local(param, value)


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


def _unflattened(
    flat: torch.Tensor, params: list[nn.Parameter]
) -> Iterator[tuple[nn.Parameter, torch.Tensor]]:
    """Each parameter with its part of ``flat`` (their values end to end), shaped as it."""
    for param, value in zip(params, flat.split([p.numel() for p in params]), strict=True):
        yield param, value.view(param.shape)


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
