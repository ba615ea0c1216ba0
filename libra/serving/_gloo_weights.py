"""Weights sent over a gloo process group instead of the disk: the wire, both ends.

The trainer's rank 0 is rank 0 of a group of its own with every serving worker (rank
``offset + i``), joined once through a TCP store the trainer hosts. Each version is
broadcast from rank 0 in buckets: the tensors, in the order of their metadata, packed as
bytes (each padded to 8, so every tensor starts aligned) into buffers of at most
``bucket_bytes`` (a tensor larger than that is a bucket of its own), so every rank cuts
the same buckets from the same metadata and nothing but the bytes crosses the wire. The
receiving end, inside vLLM, is ``libra.serving._vllm_gloo_engine``; the sending end runs
in the trainer's processes (``libra.trainer.SendWeights``). Plain torch: no vLLM on the
trainer's side.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "TensorMeta",
    "buckets",
    "open_weights_group",
    "receive_weights",
    "send_weights",
    "weights_metadata",
]

DEFAULT_BUCKET_BYTES = 256 * 1024**2
_STORE_PREFIX = "libra-weights"
_ALIGN = 8


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """What a receiver must know of a tensor to cut it out of a bucket."""

    name: str
    dtype: str  # torch's name: "float32", "bfloat16"
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        import torch

        itemsize: int = getattr(torch, self.dtype).itemsize
        return math.prod(self.shape) * itemsize

    @property
    def padded(self) -> int:
        return -(-self.nbytes // _ALIGN) * _ALIGN


def buckets(metas: Sequence[TensorMeta], bucket_bytes: int) -> list[list[TensorMeta]]:
    """``metas`` in order, cut into runs of at most ``bucket_bytes`` bytes."""
    cut: list[list[TensorMeta]] = []
    used = bucket_bytes
    for meta in metas:
        if used + meta.padded > bucket_bytes:
            cut.append([])
            used = 0
        cut[-1].append(meta)
        used += meta.padded
    return cut


def open_weights_group(host: str, port: int, rank: int, world_size: int, timeout_s: float) -> Any:
    """Join the weights group (rank 0 hosts its store): a ``ProcessGroupGloo`` apart from
    any default group the process has (vLLM's own, FSDP's)."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout)
    return dist.ProcessGroupGloo(dist.PrefixStore(_STORE_PREFIX, store), rank, world_size, timeout)


def send_weights(
    group: Any, tensors: Sequence[tuple[str, torch.Tensor]], bucket_bytes: int
) -> None:
    """Broadcast ``tensors`` (rank 0), bucket by bucket, in the order of ``metadata``."""
    import torch

    by_name = dict(tensors)
    for bucket in buckets(weights_metadata(tensors), bucket_bytes):
        buffer = torch.zeros(sum(meta.padded for meta in bucket), dtype=torch.uint8)
        start = 0
        for meta in bucket:
            raw = by_name[meta.name].detach().contiguous().view(-1).view(torch.uint8)
            buffer[start : start + meta.nbytes] = raw
            start += meta.padded
        _broadcast(group, buffer)


def receive_weights(
    group: Any, metas: Sequence[TensorMeta], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """What :func:`send_weights` broadcasts, one bucket at a time, as named tensors."""
    import torch

    for bucket in buckets(metas, bucket_bytes):
        buffer = torch.empty(sum(meta.padded for meta in bucket), dtype=torch.uint8)
        _broadcast(group, buffer)
        named, start = [], 0
        for meta in bucket:
            raw = buffer[start : start + meta.nbytes]
            named.append((meta.name, raw.view(getattr(torch, meta.dtype)).view(meta.shape)))
            start += meta.padded
        yield named


def weights_metadata(tensors: Sequence[tuple[str, torch.Tensor]]) -> list[TensorMeta]:
    return [
        TensorMeta(name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape))
        for name, tensor in tensors
    ]


def _broadcast(group: Any, buffer: torch.Tensor) -> None:
    import torch.distributed as dist

    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([buffer], options).wait()
