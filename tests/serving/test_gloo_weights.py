"""The gloo weight transport's wire: what rank 0 sends, every other rank receives, whole
and in order, however the buckets cut it (tensors of several dtypes and odd sizes, one
larger than a bucket)."""

from __future__ import annotations

from pathlib import Path

import torch

from libra._net import free_port
from libra.serving import TensorMeta, open_weights_group, send_weights, weights_metadata
from libra.serving._gloo_weights import buckets, receive_weights
from libra.trainer import spawn

BUCKET_BYTES = 64


def _tensors() -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [
        ("a.weight", torch.randn(3, 5, generator=generator)),  # 60 bytes
        ("b.bias", torch.randn(7, generator=generator).to(torch.bfloat16)),  # 14: padded
        ("c.weight", torch.randn(40, generator=generator)),  # 160: a bucket of its own
        ("d.ids", torch.arange(3, dtype=torch.int64)),
    ]


def _rank(port: int, world: int, out: Path) -> int:
    import os

    rank = int(os.environ["RANK"])  # as spawn sets it: no default group is needed
    group = open_weights_group("127.0.0.1", port, rank, world, timeout_s=60)
    tensors = _tensors()
    if rank == 0:
        send_weights(group, tensors, BUCKET_BYTES)
        return 0
    received = [
        t
        for bucket in receive_weights(group, weights_metadata(tensors), BUCKET_BYTES)
        for t in bucket
    ]
    torch.save(received, out / f"rank{rank}.pt")
    return len(received)


def test_every_receiver_gets_every_tensor_whole(tmp_path: Path) -> None:
    assert spawn(3, _rank, free_port(), 3, tmp_path) == [0, 4, 4]
    for rank in (1, 2):
        received = torch.load(tmp_path / f"rank{rank}.pt")
        for (name, sent), (got_name, got) in zip(_tensors(), received, strict=True):
            assert name == got_name and got.dtype == sent.dtype
            torch.testing.assert_close(got, sent, rtol=0, atol=0)


def test_buckets_keep_the_order_and_the_limit() -> None:
    metas = weights_metadata(_tensors())
    cut = buckets(metas, BUCKET_BYTES)
    assert [meta for bucket in cut for meta in bucket] == metas
    assert [[meta.name for meta in bucket] for bucket in cut] == [
        ["a.weight"],  # 64 with its padding: full
        ["b.bias"],
        ["c.weight"],  # more than a bucket: alone
        ["d.ids"],
    ]
    assert TensorMeta("x", "bfloat16", (7,)).padded == 16
