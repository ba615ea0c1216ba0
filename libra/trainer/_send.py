"""The trainer's end of the collective weight transport (``[sync] transport = "gloo"``):
rank 0 joins a group with the serving workers once, then broadcasts each version's
tensors, the very ones :func:`~libra.trainer.export_weights` would write
(``libra.serving._gloo_weights`` is the wire; ``libra.serving.CollectiveSync`` drives
the servers' side). Every rank runs each command (gathering the shards is collective);
only rank 0 joins and sends."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from libra.serving import TensorMeta, open_weights_group, send_weights, weights_metadata
from libra.trainer._weights import servable_tensors

if TYPE_CHECKING:
    from libra.trainer._fsdp import FSDPTrainer


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
