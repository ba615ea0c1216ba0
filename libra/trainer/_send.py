"""The trainer's end of the collective weight transport (``[sync] transport = "gloo"``):
rank 0 joins a group with the serving workers once, then broadcasts each version's
tensors, the very ones :func:`~libra.trainer.export_weights` would write
(``libra.serving._gloo_weights`` is the wire; ``libra.serving.CollectiveSync`` drives
the servers' side). Every rank runs each command (gathering the shards is collective);
only rank 0 joins and sends."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

from libra._net import free_port
from libra.serving import (
    CollectiveSync,
    TensorMeta,
    open_weights_group,
    send_weights,
    weights_metadata,
)
from libra.trainer._weights import servable_tensors

if TYPE_CHECKING:
    from libra.trainer._fsdp import FSDPTrainer
    from libra.trainer._process import TrainerWorld

# The transport's scope: servers on the trainer's machine (the run's own vLLM).
_LOOPBACK = "127.0.0.1"


async def join_weight_group(trainer: TrainerWorld, sync: CollectiveSync) -> None:
    """``sync``'s servers and the trainer's rank 0 join one group (rank 0 hosts it)."""
    port = free_port(_LOOPBACK)
    world = 1 + len(sync.endpoints)
    join = JoinWeightGroup(_LOOPBACK, port, world, sync.config.timeout_s)
    await sync.join(_LOOPBACK, port, partial(trainer.call, join))


@dataclass(frozen=True, slots=True)
class JoinWeightGroup:
    """Rank 0 hosts the group's store and joins as rank 0 of ``world_size``; a group it
    had before is left."""

    host: str
    port: int
    world_size: int
    timeout_s: float

    def run(self, trainer: FSDPTrainer) -> None:
        trainer.weight_group = None
        if trainer.dist.is_main:
            trainer.weight_group = open_weights_group(
                self.host, self.port, 0, self.world_size, self.timeout_s
            )


@dataclass(frozen=True, slots=True)
class WeightsMetadata:
    """What each version sends, by name, dtype and shape (the servers are told first)."""

    dtype: str | None

    def run(self, trainer: FSDPTrainer) -> list[TensorMeta]:
        return weights_metadata(servable_tensors(trainer, self.dtype))


@dataclass(frozen=True, slots=True)
class SendWeights:
    """Broadcast the trainer's weights to the group, in buckets of ``bucket_bytes``."""

    dtype: str | None
    bucket_bytes: int

    def run(self, trainer: FSDPTrainer) -> None:
        tensors = servable_tensors(trainer, self.dtype)
        if trainer.dist.is_main:
            if trainer.weight_group is None:
                raise RuntimeError("SendWeights before JoinWeightGroup")
            send_weights(trainer.weight_group, tensors, self.bucket_bytes)
