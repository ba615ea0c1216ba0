"""New weights into every serving instance: pause, reload from a folder, reset the
prefix cache, bump the endpoint's ``weight_version``, resume.

:class:`WeightSync` points each server at a Hugging Face folder of new weights (the
trainer's export, ``libra.trainer.export_weights``): pause (in the configured mode),
``reload_weights`` with ``weights_path``, reset the prefix cache (KV computed by the old
weights must not be reused), bump the endpoint's version, resume. The training loop and
the gateway's admin API both sync through it.

A folder of LoRA adapters (``adapter_config.json``, ``libra.trainer._lora``) is loaded
with ``/v1/load_lora_adapter`` instead, in place, under the name the endpoint's requests
call (``Endpoint.model``): the server must run with ``--enable-lora`` and
``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` (``libra.serving.with_lora_adapter``).

Transport: ``disk`` (safetensors through the file system) is the only one. A GPU
transport (NCCL broadcast into the servers, or vLLM's weight-transfer API) would be a
second value of :attr:`WeightSyncConfig.transport` behind the same :meth:`WeightSync.sync`.
"""

from __future__ import annotations

import json
import logging
import time
import urllib.parse
from collections.abc import Mapping, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Literal, Protocol, Self

import anyio
import httpx
from pydantic import Field

from libra.config import Section
from libra.fleet import Endpoint

__all__ = [
    "WEIGHTS_FILE",
    "ControlTransport",
    "SyncReport",
    "WeightSync",
    "WeightSyncConfig",
    "WeightSyncError",
]

log = logging.getLogger("libra.serving")

#: The file a weights folder holds (one safetensors file: the embedded model is small).
WEIGHTS_FILE = "model.safetensors"
#: What a folder of LoRA adapters holds (peft's files).
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


class WeightSyncError(RuntimeError):
    """A server refused a step of the weight sync (``failed``: why, by endpoint name)."""

    def __init__(self, message: str, failed: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.failed = failed or {}


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


class ControlTransport(Protocol):
    """How the sync reaches the servers: a POST and its answer. The engine's HTTP
    transports are ones (so an in-process emulated fleet is reached as the engine reaches
    it); by default the sync opens an httpx client of its own."""

    async def post(
        self, url: str, body: bytes, headers: Mapping[str, str], timeout_s: float
    ) -> tuple[int, bytes]: ...


class WeightSync:
    """Pushes weight folders into serving endpoints and bumps their ``weight_version``.

    The servers need vLLM's dev mode (``VLLM_SERVER_DEV_MODE=1``) for ``/pause``,
    ``/collective_rpc`` and ``/reset_prefix_cache``. Any failure, on any endpoint, is
    one :class:`WeightSyncError` naming each endpoint that failed and why.
    """

    def __init__(
        self,
        endpoints: Sequence[Endpoint],
        config: WeightSyncConfig | None = None,
        transport: ControlTransport | None = None,
    ):
        self.endpoints = list(endpoints)
        self.config = config if config is not None else WeightSyncConfig()
        self.transport = transport

    async def sync(self, weights: str | Path, version: int) -> SyncReport:
        """Load ``weights`` (a folder from ``libra.trainer.export_weights``) into every
        endpoint."""
        path = Path(await anyio.Path(weights).resolve())
        if not await _holds(path, (WEIGHTS_FILE,)) and not await _holds(path, ADAPTER_FILES):
            raise WeightSyncError(f"{path} holds neither {WEIGHTS_FILE} nor LoRA adapters")
        started = time.perf_counter()
        seconds: dict[str, float] = {}
        errors: dict[str, str] = {}

        async def sync_one(transport: ControlTransport, endpoint: Endpoint) -> None:
            name = endpoint.name or endpoint.url
            try:
                seconds[name] = await self._sync_one(transport, endpoint, path, version)
            except Exception as error:  # each endpoint's failure is reported, none lost
                errors[name] = str(error) if isinstance(error, WeightSyncError) else repr(error)

        async with AsyncExitStack() as stack:
            transport: ControlTransport
            if self.transport is not None:
                transport = self.transport
            else:
                transport = await stack.enter_async_context(_HttpxControl())
            async with anyio.create_task_group() as group:
                for endpoint in self.endpoints:
                    group.start_soon(sync_one, transport, endpoint)
        if errors:
            raise WeightSyncError(
                f"weights v{version} not loaded into "
                + "; ".join(f"{name}: {error}" for name, error in errors.items()),
                errors,
            )
        report = SyncReport(version, path, time.perf_counter() - started, seconds)
        log.info(
            "weights v%d synced into %d endpoints in %.2f s (%s)",
            version,
            len(self.endpoints),
            report.seconds,
            ", ".join(f"{name} {s:.2f} s" for name, s in seconds.items()),
        )
        return report

    async def _sync_one(
        self, transport: ControlTransport, endpoint: Endpoint, path: Path, version: int
    ) -> float:
        """Pause, reload, reset the prefix cache, resume: one endpoint; its seconds."""
        started = time.perf_counter()
        control = _Control(transport, endpoint, self.config.timeout_s)
        await control.post("/pause", {"mode": self.config.pause_mode})
        try:
            if await _holds(path, ADAPTER_FILES):
                adapter = {"lora_name": endpoint.model, "lora_path": str(path)}
                await control.post("/v1/load_lora_adapter", body={**adapter, "load_inplace": True})
            else:
                rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(path)}}
                await control.post("/collective_rpc", body=rpc)
            await _reset_prefix_cache(control)
            endpoint.weight_version = version
        finally:
            # Shielded: a server left paused would stall every trajectory routed to it.
            with anyio.CancelScope(shield=True):
                await control.post("/resume")
        return time.perf_counter() - started


@dataclass(frozen=True, slots=True)
class _Control:
    """One endpoint's control API."""

    transport: ControlTransport
    endpoint: Endpoint
    timeout_s: float

    async def post(
        self, path: str, params: dict[str, str] | None = None, body: object = None
    ) -> bytes:
        url = self.endpoint.url.rstrip("/") + path
        if params:
            url += "?" + urllib.parse.urlencode(params)
        payload = b"" if body is None else json.dumps(body).encode()
        headers = {**self.endpoint.headers, "content-type": "application/json"}
        status, answer = await self.transport.post(url, payload, headers, self.timeout_s)
        if status != 200:
            raise WeightSyncError(f"POST {path} answered {status}: {answer[:200]!r}")
        return answer


async def _holds(folder: Path, files: Sequence[str]) -> bool:
    for name in files:
        if not await anyio.Path(folder / name).is_file():
            return False
    return True


async def _reset_prefix_cache(control: _Control) -> None:
    """Drop cached KV; requests frozen by a ``keep`` pause are preempted and recomputed
    with the new weights when they resume, instead of continuing on stale KV."""
    answer = await control.post("/reset_prefix_cache", {"reset_running_requests": "true"})
    if not json.loads(answer or b"{}").get("success", False):
        raise WeightSyncError(f"the prefix cache was not reset: {answer[:200]!r}")


class _HttpxControl:
    """The default :class:`ControlTransport`: an httpx client of the sync's own."""

    def __init__(self) -> None:
        self.client = httpx.AsyncClient()

    async def post(
        self, url: str, body: bytes, headers: Mapping[str, str], timeout_s: float
    ) -> tuple[int, bytes]:
        response = await self.client.post(url, content=body, headers=headers, timeout=timeout_s)
        return response.status_code, response.content

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.client.aclose()
