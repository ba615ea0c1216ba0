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

Transports (:attr:`WeightSyncConfig.transport`): ``disk``, a folder through the file
system (:class:`WeightSync`), and ``gloo``, the tensors broadcast from the trainer's rank 0
over a process group the servers joined (:class:`CollectiveSync`: vLLM's weight-transfer
API, ``/init_weight_transfer_engine``, ``/start_weight_update``, ``/update_weights``,
``/finish_weight_update``, with Libra's gloo engine in the servers,
``libra.serving._vllm_gloo_engine``). Both pause, reset the prefix cache, bump the
version and resume the same way.
"""

from __future__ import annotations

import json
import logging
import time
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, Protocol, Self

import anyio
import httpx
from pydantic import Field, PositiveInt

from libra.config import Section
from libra.fleet import Endpoint
from libra.serving._gloo_weights import TensorMeta

__all__ = [
    "WEIGHTS_FILE",
    "CollectiveSync",
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

    transport: Literal["disk", "gloo"] = Field(
        default="disk",
        description="disk: a safetensors folder, reloaded by the servers; gloo: the tensors "
        "broadcast from the trainer over a process group (the run's own vLLM only; CPU and GPU)",
    )
    bucket_mb: PositiveInt = Field(
        256, description="gloo: the most MiB broadcast at once (one tensor may be more)"
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

        async with (
            _transport_or_own(self.transport) as transport,
            anyio.create_task_group() as group,
        ):
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


class CollectiveSync:
    """Loads weights the trainer broadcasts into every endpoint (``transport = "gloo"``).

    :meth:`join` makes each endpoint's workers join the trainer's group (rank 0: the
    trainer, which joins meanwhile); :meth:`sync` loads one version: pause, start the
    update, tell each server the tensors' metadata while the trainer broadcasts them,
    finish the update, reset the prefix cache, bump the version, resume. The servers run
    with ``--weight-transfer-config '{"backend": "gloo"}'`` and in dev mode.
    """

    def __init__(
        self,
        endpoints: Sequence[Endpoint],
        config: WeightSyncConfig,
        transport: ControlTransport | None = None,
    ) -> None:
        self.endpoints = list(endpoints)
        self.config = config
        self.transport = transport  # None: an httpx client per call, of its own

    async def join(
        self, host: str, port: int, trainer_joins: Callable[[], Awaitable[object]]
    ) -> None:
        world = 1 + len(self.endpoints)
        info = {"master_address": host, "master_port": port, "world_size": world}
        info["bucket_bytes"] = self.config.bucket_mb * 1024**2

        async def init(control: _Control, offset: int) -> None:
            body = {"init_info": {**info, "rank_offset": offset}}
            await control.post("/init_weight_transfer_engine", body=body)

        async with self._controls() as controls, anyio.create_task_group() as group:
            for offset, control in enumerate(controls, start=1):
                group.start_soon(init, control, offset)
            await trainer_joins()

    async def sync(
        self, version: int, metas: Sequence[TensorMeta], send: Callable[[], Awaitable[object]]
    ) -> SyncReport:
        started = time.perf_counter()
        update: dict[str, list[Any]] = {
            "names": [meta.name for meta in metas],
            "dtype_names": [meta.dtype for meta in metas],
            "shapes": [list(meta.shape) for meta in metas],
        }
        async with self._controls() as controls:
            await self._load(controls, version, update, send)
        seconds = time.perf_counter() - started
        log.info(
            "weights v%d broadcast into %d endpoints in %.2f s", version, len(controls), seconds
        )
        return SyncReport(version, Path(), seconds, {})

    async def _load(
        self,
        controls: Sequence[_Control],
        version: int,
        update: dict[str, list[Any]],
        send: Callable[[], Awaitable[object]],
    ) -> None:
        await _each(controls, lambda c: c.post("/pause", {"mode": self.config.pause_mode}))
        try:
            await _each(controls, lambda c: c.post("/start_weight_update"))
            async with anyio.create_task_group() as group:
                for control in controls:
                    group.start_soon(
                        partial(control.post, "/update_weights"), None, {"update_info": update}
                    )
                await send()
            finish = {"weight_version": str(version)}
            await _each(controls, lambda c: c.post("/finish_weight_update", body=finish))
            await _each(controls, _reset_prefix_cache)
            for endpoint in self.endpoints:
                endpoint.weight_version = version
        finally:
            with anyio.CancelScope(shield=True):
                await _each(controls, lambda c: c.post("/resume"))

    @asynccontextmanager
    async def _controls(self) -> AsyncIterator[list[_Control]]:
        async with _transport_or_own(self.transport) as transport:
            timeout_s = self.config.timeout_s
            yield [_Control(transport, endpoint, timeout_s) for endpoint in self.endpoints]


@asynccontextmanager
async def _transport_or_own(transport: ControlTransport | None) -> AsyncIterator[ControlTransport]:
    """``transport``, or an httpx client of the caller's own while the block runs."""
    if transport is not None:
        yield transport
        return
    async with _HttpxControl() as own:
        yield own


async def _each(
    controls: Sequence[_Control], call: Callable[[_Control], Coroutine[Any, Any, object]]
) -> None:
    async with anyio.create_task_group() as group:
        for control in controls:
            group.start_soon(call, control)


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
