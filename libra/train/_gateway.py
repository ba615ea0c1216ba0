"""``libra train --serve URL`` where ``URL`` is a ``libra serve`` gateway.

A gateway is told from a vLLM server (or any other) by its admin API: its answer to
``GET /admin/status``, a 401 without a key, carries ``X-Libra-Admin``. That first probe
carries no key, so the admin key never reaches a server that is not a gateway.

Through a gateway the run's rollouts go to the gateway's OpenAI surface (one endpoint:
the gateway's own scheduler routes each call over its fleet): ``/tokenize`` renders the
conversation and ``/v1/completions`` with ``return_token_ids`` and ``logprobs: 0``
returns the sampled ids and their logprobs, so the records stay exact; each call names
its trajectory (``X-Libra-Session``), so the gateway's scheduler sees a trajectory's
turns as one (it forgets it once idle for the gateway's session TTL). Weights go
through the admin API: pause, ``reload_weights`` from the exported folder (a path the
gateway's machine must see: a shared file system when they differ) as the new version,
resume; then every upstream's reported version must be the new one.

The admin key is ``$LIBRA_ADMIN_KEY`` (the gateway's own admin key variable); it also
opens the gateway's user routes. Without it, or when the gateway refuses it, the run
stops before it starts, in one line (:class:`GatewayRefused`, exit status 1 like every
server ``--serve`` cannot attach to).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import anyio
import httpx

from libra.openai import ADMIN_HEADER, SESSION_HEADER
from libra.train._attach import AttachError

ADMIN_KEY_VAR = "LIBRA_ADMIN_KEY"

__all__ = [
    "ADMIN_HEADER",
    "ADMIN_KEY_VAR",
    "SESSION_HEADER",
    "GatewayClient",
    "GatewayRefused",
    "GatewaySyncError",
    "find_gateway",
]


class GatewayRefused(AttachError):
    """The gateway's admin API is not open to this run: no admin key, or a refused one."""


class GatewaySyncError(RuntimeError):
    """A weight sync through the gateway failed, or left the fleet on another version."""


@dataclass(frozen=True)
class GatewayClient:
    """A client of a ``libra serve`` gateway (the server is ``libra.gateway``): its URL
    and the admin key it accepted."""

    url: str
    key: str
    timeout_s: float = 600.0

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}

    async def sync(self, folder: Path, version: int) -> float:
        """Pause the gateway, reload every upstream from ``folder`` as ``version``,
        resume (even after a failed reload); the seconds it took. Raises
        :class:`GatewaySyncError` when a call fails or an upstream reports another
        version afterwards."""
        started = time.perf_counter()
        body = {"path": str(await anyio.Path(folder).absolute()), "version": version}
        async with self._client() as client:
            await _admin(client, "POST", "/admin/pause")
            try:
                await _admin(client, "POST", "/admin/reload_weights", body)
            finally:
                await _admin(client, "POST", "/admin/resume")
            versions = await self.versions(client)
        stale = {name: held for name, held in versions.items() if held != version}
        if stale:
            raise GatewaySyncError(f"after the sync to v{version} the gateway reports {stale}")
        return time.perf_counter() - started

    async def versions(self, client: httpx.AsyncClient | None = None) -> dict[str, int]:
        """The weight version of every upstream, as the gateway reports it."""
        if client is None:
            async with self._client() as own:
                return await self.versions(own)
        status = await _admin(client, "GET", "/admin/status")
        versions = status.get("versions")
        if not isinstance(versions, dict):
            raise GatewaySyncError(f"the gateway's /admin/status holds no versions: {status}")
        return {str(name): int(held) for name, held in versions.items()}

    def _client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, headers=self.headers, timeout=self.timeout_s)


async def _admin(
    client: httpx.AsyncClient, method: str, path: str, body: object = None
) -> dict[str, object]:
    try:
        response = await client.request(method, path, json=body)
    except httpx.HTTPError as error:
        raise GatewaySyncError(f"{path} on the gateway failed: {error!r}") from error
    if response.status_code != 200:
        raise GatewaySyncError(
            f"{path} on the gateway answered {response.status_code}: {_message(response)}"
        )
    answer: dict[str, object] = response.json()
    return answer


async def find_gateway(
    url: str, timeout_s: float = 30.0, sync_timeout_s: float = 600.0
) -> GatewayClient | None:
    """The gateway at ``url`` with its admin key checked (its weight syncs then wait up
    to ``sync_timeout_s`` per call), or None when ``url`` is no gateway. Raises
    :class:`GatewayRefused` for a gateway without a usable key, and
    :class:`AttachError` when ``url`` does not answer."""
    url = url.rstrip("/").removesuffix("/v1")
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s) as client:
        try:
            if ADMIN_HEADER not in (await client.get("/admin/status")).headers:
                return None
            key = os.environ.get(ADMIN_KEY_VAR, "").strip()
            if not key:
                raise GatewayRefused(
                    f"{url} is a libra serve gateway: set {ADMIN_KEY_VAR} to its admin key "
                    "(weight syncs go through its admin API)"
                )
            answer = await client.get("/admin/status", headers={"Authorization": f"Bearer {key}"})
        except httpx.HTTPError as error:
            raise AttachError(f"{url} did not answer GET /admin/status: {error!r}") from error
    if answer.status_code != 200:
        raise GatewayRefused(
            f"the gateway at {url} refused the admin key in {ADMIN_KEY_VAR} "
            f"(HTTP {answer.status_code}: {_message(answer)})"
        )
    return GatewayClient(url, key, timeout_s=sync_timeout_s)


def _message(response: httpx.Response) -> str:
    """The error message of an OpenAI-shaped error body, else the body's start."""
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return " ".join(response.text[:200].split())
