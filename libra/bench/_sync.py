"""What each weight transport costs: the same trainer's weights into the same real vLLM,
through the disk and through the gloo broadcast (``[sync] transport``).

One vLLM (dev mode, fp32, Libra's gloo engine) serves an untied copy of the model; one
trainer rank (:class:`~libra.trainer.TrainerProcess`) holds it. Each version is synced as
a training run syncs it, admission paused: ``disk`` exports a folder
(:class:`~libra.trainer.Export`) and the server reloads it
(:class:`~libra.serving.WeightSync`); ``gloo`` broadcasts the tensors from the trainer
into the server (:class:`~libra.serving.CollectiveSync`), after one join. The first sync of
each is a warm-up, untimed; the rest are timed (median).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from libra.fleet import Endpoint
from libra.serving import (
    CollectiveSync,
    TensorMeta,
    VLLMServer,
    VLLMServerConfig,
    WeightSync,
    WeightSyncConfig,
)
from libra.trainer import (
    Export,
    SendWeights,
    TrainerConfig,
    TrainerProcess,
    WeightsMetadata,
    join_weight_group,
    servable_model,
)

__all__ = ["TransportResult", "bench_sync"]

_SERVED = "bench"
_DTYPE = "float32"  # as libra train exports by default


@dataclass(frozen=True, slots=True)
class TransportResult:
    """One transport: median seconds of a version's sync, and of its trainer-side part."""

    transport: str
    syncs: int
    sync_s: float  # all of it: export (or broadcast) and load, the servers paused
    export_s: float | None  # disk: the folder written; gloo: None (nothing is written)
    megabytes: float  # what each sync moves: the served tensors, in fp32


async def bench_sync(model_dir: Path, syncs: int = 3) -> list[TransportResult]:
    """``syncs`` timed syncs through each transport, after a warm-up of each."""
    with tempfile.TemporaryDirectory(prefix="libra-bench-sync-") as folder:
        run_dir = Path(folder)
        served = servable_model(model_dir, run_dir)
        config = VLLMServerConfig(
            dev_mode=True,
            max_model_len=1024,
            startup_timeout_s=900.0,
            dtype=_DTYPE,
            extra_args=("--weight-transfer-config", '{"backend": "gloo"}'),
        )
        trainer_config = TrainerConfig(backend="gloo", cpu_threads=1)
        async with (
            TrainerProcess(model_dir, trainer_config, world_size=1) as trainer,
            VLLMServer(served, served_model_name=_SERVED, config=config) as server,
        ):
            endpoint = Endpoint(url=server.url, model=_SERVED, name="vllm-0")
            metas = await trainer.call(WeightsMetadata(_DTYPE))
            megabytes = sum(meta.nbytes for meta in metas) / 1024**2
            disk = await _disk(trainer, endpoint, run_dir, syncs)
            gloo = await _gloo(trainer, endpoint, metas, syncs)
    return [
        TransportResult(
            "disk", syncs, statistics.median(disk[0]), statistics.median(disk[1]), megabytes
        ),
        TransportResult("gloo", syncs, statistics.median(gloo), None, megabytes),
    ]


async def _disk(
    trainer: TrainerProcess, endpoint: Endpoint, run_dir: Path, syncs: int
) -> tuple[list[float], list[float]]:
    sync_s, export_s = [], []
    for version in range(1, syncs + 2):
        started = time.perf_counter()
        folder = await trainer.call(Export(run_dir, version, _DTYPE))
        exported = time.perf_counter()
        await WeightSync([endpoint]).sync(folder, version)
        sync_s.append(time.perf_counter() - started)
        export_s.append(exported - started)
    return sync_s[1:], export_s[1:]


async def _gloo(
    trainer: TrainerProcess, endpoint: Endpoint, metas: list[TensorMeta], syncs: int
) -> list[float]:
    config = WeightSyncConfig(transport="gloo")
    sync = CollectiveSync([endpoint], config)
    await join_weight_group(trainer, sync)
    send = SendWeights(_DTYPE, config.bucket_mb * 1024**2)
    seconds = []
    for version in range(1, syncs + 2):
        started = time.perf_counter()
        await sync.sync(100 + version, metas, partial(trainer.call, send))
        seconds.append(time.perf_counter() - started)
    return seconds[1:]
