"""New weights into every serving instance: pause, reload from a folder, reset the
prefix cache, bump the endpoint's ``weight_version``, resume.

:class:`WeightSync` points each server at a Hugging Face folder of new weights (the
trainer's export, ``libra.train.export_weights``): pause (in the configured mode),
``reload_weights`` with ``weights_path``, reset the prefix cache (KV computed by the old
weights must not be reused), bump the endpoint's version, resume. The training loop and
the gateway's admin API both sync through it.

Transport: ``disk`` (safetensors through the file system) is the only one. A GPU
transport (NCCL broadcast into the servers, or vLLM's weight-transfer API) would be a
second value of :attr:`WeightSyncConfig.transport` behind the same :meth:`WeightSync.sync`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import anyio
import httpx
from pydantic import Field

from libra.config import Section
from libra.fleet import Endpoint

__all__ = ["WEIGHTS_FILE", "SyncReport", "WeightSync", "WeightSyncConfig", "WeightSyncError"]

log = logging.getLogger("libra.serving")

#: The file a weights folder holds (one safetensors file: the embedded model is small).
WEIGHTS_FILE = "model.safetensors"


class WeightSyncError(RuntimeError):
    """A server refused a step of the weight sync."""


class WeightSyncConfig(Section):
    """How new weights reach the servers."""

    transport: Literal["disk"] = Field(
        default="disk", description="disk: safetensors folder + reload_weights (CPU and GPU)"
    )
    pause_mode: Literal["abort", "keep", "wait"] = Field(
        default="keep",
        description="abort ends in-flight requests; keep freezes them until resume; "
        "wait lets them finish first",
    )
    timeout_s: float = Field(default=300.0, gt=0, description="per control request")


@dataclass(frozen=True, slots=True)
class SyncReport:
    """One weight sync: which version, from where, how long (overall and per endpoint)."""

    version: int
    path: Path
    seconds: float
    endpoint_seconds: dict[str, float]


class WeightSync:
    """Pushes weight folders into serving endpoints and bumps their ``weight_version``.

    The servers need vLLM's dev mode (``VLLM_SERVER_DEV_MODE=1``) for ``/pause``,
    ``/collective_rpc`` and ``/reset_prefix_cache``.
    """

    def __init__(self, endpoints: Sequence[Endpoint], config: WeightSyncConfig | None = None):
        self.endpoints = list(endpoints)
        self.config = config if config is not None else WeightSyncConfig()

    async def sync(self, weights: str | Path, version: int) -> SyncReport:
        """Load ``weights`` (a folder from :func:`export_weights`) into every endpoint."""
        path = await anyio.Path(weights).resolve()
        if not await (path / WEIGHTS_FILE).is_file():
            raise WeightSyncError(f"{path} holds no {WEIGHTS_FILE}")
        started = time.perf_counter()
        seconds: dict[str, float] = {}
        async with (
            httpx.AsyncClient(timeout=self.config.timeout_s) as client,
            anyio.create_task_group() as group,
        ):
            for endpoint in self.endpoints:
                group.start_soon(self._sync_one, client, endpoint, Path(path), version, seconds)
        report = SyncReport(version, Path(path), time.perf_counter() - started, seconds)
        log.info(
            "weights v%d synced into %d endpoints in %.2f s (%s)",
            version,
            len(self.endpoints),
            report.seconds,
            ", ".join(f"{name} {s:.2f} s" for name, s in seconds.items()),
        )
        return report

    async def _sync_one(
        self,
        client: httpx.AsyncClient,
        endpoint: Endpoint,
        path: Path,
        version: int,
        seconds: dict[str, float],
    ) -> None:
        started = time.perf_counter()
        url = endpoint.url.rstrip("/")
        await _call(client, "POST", f"{url}/pause", params={"mode": self.config.pause_mode})
        try:
            rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(path)}}
            await _call(client, "POST", f"{url}/collective_rpc", json=rpc)
            await _reset_prefix_cache(client, url)
            endpoint.weight_version = version
        finally:
            # Shielded: a server left paused would stall every trajectory routed to it.
            with anyio.CancelScope(shield=True):
                await _call(client, "POST", f"{url}/resume")
        seconds[endpoint.name or endpoint.url] = time.perf_counter() - started


async def _reset_prefix_cache(client: httpx.AsyncClient, url: str) -> None:
    """Drop cached KV; requests frozen by a ``keep`` pause are preempted and recomputed
    with the new weights when they resume, instead of continuing on stale KV."""
    response = await _call(
        client, "POST", f"{url}/reset_prefix_cache", params={"reset_running_requests": "true"}
    )
    if not response.json().get("success", False):
        raise WeightSyncError(f"{url} did not reset its prefix cache: {response.text[:200]}")


async def _call(client: httpx.AsyncClient, method: str, url: str, **kwargs: Any) -> httpx.Response:
    response = await client.request(method, url, **kwargs)
    if response.status_code != 200:
        raise WeightSyncError(f"{method} {url} answered {response.status_code}: {response.text}")
    return response
