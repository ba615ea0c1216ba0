"""Weight publishing: each version the trainer exports is loaded into every serving
endpoint (admission paused meanwhile; through a ``libra serve`` gateway's admin API when
the run serves there), the exports kept to what the servers may still need, and the
logprob probe of a version just served. With ``[sync] transport = "gloo"`` no folder is
written: the trainer broadcasts each version to the servers, which joined its group at
the first publish (and join again after one of them restarted)."""

from __future__ import annotations

import shutil
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import anyio
import httpx

from libra.engine import RolloutSession, TrajectoryRecord
from libra.fleet import Endpoint
from libra.sched import Scheduler
from libra.serving import CollectiveSync, TensorMeta, WeightSync, WeightSyncError
from libra.train._gateway import GatewayClient
from libra.train._settings import RunSettings
from libra.trainer import (
    Export,
    LogprobGap,
    Logprobs,
    SendWeights,
    TrainerWorld,
    WeightsMetadata,
    join_weight_group,
    logprob_gap,
    server_prompt_logprobs,
)

_PROBE_TOKENS = 1024


@dataclass
class ServedWeights:
    """The weights the servers should hold now: a server restarted mid-run is given these
    (``folder`` None: the ones the servers start on)."""

    folder: Path | None = None
    version: int = 0
    #: Held while new weights load into the fleet: an instance starting meanwhile takes
    #: them once the load is over.
    lock: anyio.Lock = field(default_factory=anyio.Lock)
    #: Writes a version that was broadcast (no folder holds it) to the disk.
    export: Callable[[int], Awaitable[Path]] | None = None
    #: A server restarted since the servers joined the trainer's group: join again.
    rejoin: bool = False

    def __call__(self) -> tuple[Path | None, int]:
        return self.folder, self.version

    async def on_disk(self, version: int) -> Path:
        """For a restarted server (``libra.serving.OnDisk``): it is out of the group."""
        assert self.export is not None, "a broadcast version without an exporter"
        self.rejoin = True
        return await self.export(version)


@dataclass
class Publisher:
    """Moves the trainer's weights into the run's servers."""

    config: RunSettings
    run_dir: Path
    trainer: TrainerWorld
    session: RolloutSession
    endpoints: list[Endpoint]
    scheduler: Scheduler
    served: ServedWeights = field(default_factory=ServedWeights)
    gateway: GatewayClient | None = None  # a libra serve gateway: syncs go through its admin API
    _metas: list[TensorMeta] | None = None  # what each broadcast sends, once joined
    _members: tuple[str, ...] = ()  # the endpoints in the trainer's group, by name

    def __post_init__(self) -> None:
        self.served.export = self._export  # for a restarted server, after a broadcast

    def forget_lost_weights(self, version: int) -> None:
        """Remove the exports of versions after ``version``: steps the killed run took
        after its checkpoint, lost with it, which the resumed run exports anew."""
        for folder in (self.run_dir / "weights").glob("v*"):
            if folder.name[1:].isdigit() and int(folder.name[1:]) > version:
                shutil.rmtree(folder)

    async def serve_restored(self, version: int) -> None:
        """Serve ``version`` again: its exported folder where it was kept (an export
        never overwrites one), else the restored trainer exports it anew."""
        if version == 0:  # what the servers start on
            return
        folder = self.run_dir / "weights" / f"v{version}"
        if not folder.is_dir():
            folder = await self._export(version)
        await self.load(folder, version)

    async def probe_gap(self, records: list[TrajectoryRecord]) -> LogprobGap:
        """Trainer versus the first server on the longest exact record's first ids, both at
        the weights just synced (prompt logprobs are raw: temperature 1 on both sides)."""
        exact = [r for r in records if r.tokens == "exact" and len(r.token_ids) > 1]
        # A gateway serves no prompt logprobs: there the gap is the trained tokens' only.
        if not exact or not self.config.reloads or not self.endpoints or self.gateway:
            return LogprobGap(mean_abs=0.0, max_abs=0.0, tokens=0)
        # A cut of it: a record may outgrow the server's context (one cut at
        # max_context_tokens does), and a thousand tokens measure the numerics as well.
        ids = max(exact, key=lambda r: len(r.token_ids)).token_ids[:_PROBE_TOKENS]
        endpoint = await self._serving_endpoint()
        async with httpx.AsyncClient(timeout=self.config.sync.timeout_s) as client:
            served = await server_prompt_logprobs(client, endpoint.url, endpoint.model, ids)
        mine = await self.trainer.call(Logprobs(tuple(ids)))
        return logprob_gap(mine, served)

    async def publish(self, version: int) -> tuple[float, float]:
        """Export ``version`` and load it into every endpoint (admission paused meanwhile):
        the seconds of each; or broadcast it (``transport = "gloo"``: no export)."""
        if self.config.sync.transport == "gloo" and self.config.reloads:
            return 0.0, await self._broadcast(version)
        started = time.perf_counter()
        folder = await self._export(version)
        export_s = time.perf_counter() - started
        sync_s = await self.load(folder, version)
        self._forget_old_weights(version)
        return export_s, sync_s

    async def _broadcast(self, version: int) -> float:
        """The trainer sends ``version`` to every live endpoint over its group; the
        seconds it took, the group's join included when it happens."""
        async with self.served.lock:
            self.served.folder, self.served.version = None, version
            started = time.perf_counter()
            self.session.pause()
            try:
                live = self._live_endpoints()
                sync = CollectiveSync(live, self.config.sync, self.session.engine.http)
                members = tuple(e.name for e in live)
                if self._metas is None or self.served.rejoin or members != self._members:
                    await self._join(sync)
                    self._members = members
                bucket_bytes = self.config.sync.bucket_mb * 1024**2
                send = SendWeights(self.config.export_dtype, bucket_bytes)
                assert self._metas is not None
                await sync.sync(version, self._metas, partial(self.trainer.call, send))
            finally:
                self.session.resume()
            return time.perf_counter() - started

    async def _join(self, sync: CollectiveSync) -> None:
        await join_weight_group(self.trainer, sync)
        self._metas = await self.trainer.call(WeightsMetadata(self.config.export_dtype))
        self.served.rejoin = False

    async def _export(self, version: int) -> Path:
        settings = self.config
        export = Export(self.run_dir, version, settings.export_dtype, settings.adapter_sync)
        return await self.trainer.call(export)

    async def load(self, folder: Path, version: int) -> float:
        """Load ``folder`` into every endpoint as ``version``; the seconds it took. A
        server that is down (or goes down meanwhile) is skipped: its supervisor gives it
        these weights when it restarts."""
        async with self.served.lock:
            return await self._load_locked(folder, version)

    async def _load_locked(self, folder: Path, version: int) -> float:
        self.served.folder, self.served.version = folder, version
        self.session.pause()
        started = time.perf_counter()
        try:
            if not self.config.reloads:  # servers that hold no weights: only the version
                for endpoint in self.endpoints:
                    endpoint.weight_version = version
                return 0.0
            if self.gateway is not None:
                return await self._load_through_gateway(self.gateway, folder, version)
            live = self._live_endpoints()
            sync = WeightSync(live, self.config.sync, self.session.engine.http)
            try:
                await sync.sync(folder, version)
            except WeightSyncError as error:
                if any(self._serving(name) for name in error.failed):
                    raise
            return time.perf_counter() - started
        finally:
            self.session.resume()

    async def _load_through_gateway(
        self, gateway: GatewayClient, folder: Path, version: int
    ) -> float:
        """The gateway's fleet loads ``folder`` (and says it did); then the one endpoint
        the engine sees, the gateway, serves ``version`` and the records say so."""
        seconds = await gateway.sync(folder, version)
        for endpoint in self.endpoints:
            endpoint.weight_version = version
        return seconds

    async def _serving_endpoint(self) -> Endpoint:
        """The first endpoint that serves now: one that is down is waited for (its
        supervisor restarts it with the weights just synced)."""
        while True:
            for endpoint in self.endpoints:
                if self._serving(endpoint.name):
                    return endpoint
            await self.scheduler.router.membership.wait()

    def _live_endpoints(self) -> list[Endpoint]:
        # The router's, not the run's first ones: the pool adds and removes instances.
        endpoints = self.scheduler.router.endpoints().values()
        return [e for e in endpoints if self._serving(e.name)]

    def _serving(self, name: str) -> bool:
        instance = self.scheduler.router.by_name.get(name)
        return instance is not None and not instance.marked_down

    def _forget_old_weights(self, version: int) -> None:
        """Keep the served version, the one before it, and v0 (the servers' start folder,
        the model they were launched on): each version is the size of the model."""
        if version - 2 >= 1:
            shutil.rmtree(self.run_dir / "weights" / f"v{version - 2}", ignore_errors=True)
