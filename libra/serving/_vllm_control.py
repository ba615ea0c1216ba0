"""A vLLM server's control API: weight reloads (``/collective_rpc``), pause and resume
(vLLM's dev-mode endpoints)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import httpx

from libra.serving._vllm_config import VLLMServerConfig, VLLMServerError

PauseMode = Literal["abort", "wait", "keep"]


class VLLMControl:
    """The control calls of a server at ``url`` started with ``config`` (the server
    process is :class:`~libra.serving.VLLMServer`)."""

    config: VLLMServerConfig

    @property
    def url(self) -> str:
        raise NotImplementedError

    def reload_weights(self, timeout_s: float = 300.0) -> None:
        """Make the server reload the weights from its model folder (needs ``dev_mode``)."""
        self._require_dev_mode()
        with httpx.Client(timeout=timeout_s) as client:
            response = client.post(f"{self.url}/collective_rpc", json={"method": "reload_weights"})
        self._check_rpc(response)

    async def areload_weights(self, timeout_s: float = 300.0) -> None:
        """Async :meth:`reload_weights`."""
        self._require_dev_mode()
        async with httpx.AsyncClient(timeout=timeout_s) as client:
            response = await client.post(
                f"{self.url}/collective_rpc", json={"method": "reload_weights"}
            )
        self._check_rpc(response)

    async def pause(self, mode: PauseMode = "abort", timeout_s: float = 300.0) -> None:
        """Stop generating (``POST /pause``, needs ``dev_mode``): new requests queue until
        :meth:`resume`; ``abort`` ends those in flight now (they answer with
        ``finish_reason: "abort"`` and what they sampled so far), ``wait`` returns once
        they have finished, ``keep`` freezes them until :meth:`resume`."""
        self._require_dev_mode("pause")
        response = await self._control("POST", f"/pause?mode={mode}", timeout_s)
        self._check_control(response)

    async def resume(self, timeout_s: float = 60.0) -> None:
        """Go on generating after :meth:`pause` (``POST /resume``)."""
        self._require_dev_mode("resume")
        self._check_control(await self._control("POST", "/resume", timeout_s))

    async def is_paused(self, timeout_s: float = 60.0) -> bool:
        """Whether the server is paused (``GET /is_paused``)."""
        self._require_dev_mode("is_paused")
        response = await self._control("GET", "/is_paused", timeout_s)
        self._check_control(response)
        return bool(response.json()["is_paused"])

    async def _control(self, method: str, path: str, timeout_s: float) -> httpx.Response:
        async with httpx.AsyncClient(timeout=timeout_s) as client:
            return await client.request(method, f"{self.url}{path}")

    @staticmethod
    def _check_control(response: httpx.Response) -> None:
        if response.status_code != 200:
            raise VLLMServerError(
                f"{response.request.url.path} answered {response.status_code}: "
                f"{response.text[:500]}"
            )

    def reload_weights_from(self, weights_path: str | Path, timeout_s: float = 300.0) -> None:
        """Make the server load the weights in ``weights_path`` (a folder holding
        safetensors); later reloads read that folder too (needs ``dev_mode``)."""
        self._require_dev_mode()
        with httpx.Client(timeout=timeout_s) as client:
            response = client.post(f"{self.url}/collective_rpc", json=_reload_from(weights_path))
        self._check_rpc(response)

    async def areload_weights_from(
        self, weights_path: str | Path, timeout_s: float = 300.0
    ) -> None:
        """Async :meth:`reload_weights_from`."""
        self._require_dev_mode()
        async with httpx.AsyncClient(timeout=timeout_s) as client:
            response = await client.post(
                f"{self.url}/collective_rpc", json=_reload_from(weights_path)
            )
        self._check_rpc(response)

    def _require_dev_mode(self, what: str = "reload_weights") -> None:
        if not self.config.dev_mode:
            raise VLLMServerError(f"{what} needs a server started with dev_mode=True")

    @staticmethod
    def _check_rpc(response: httpx.Response) -> None:
        if response.status_code != 200:
            raise VLLMServerError(
                f"/collective_rpc answered {response.status_code}: {response.text[:500]}"
            )


def _reload_from(weights_path: str | Path) -> dict[str, object]:
    # vLLM's worker takes the folder as ``weights_path`` and reads it with the loader it
    # started with; /collective_rpc passes kwargs through as strings.
    path = str(Path(weights_path).resolve())
    return {"method": "reload_weights", "kwargs": {"weights_path": path}}
