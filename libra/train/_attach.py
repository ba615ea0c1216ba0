"""What ``libra train --serve URL`` checks before it trusts servers it did not start.

The loop's own server is started right (``_loop._own_server``); an attached one must have
been. Three things break training silently if it was not, so each is an error here:

- **dev mode** (``VLLM_SERVER_DEV_MODE=1``): without it there is no ``/pause``,
  ``/collective_rpc`` or ``/reset_prefix_cache``, so no weight reloads;
- **the logprobs mode**: the records' logprobs are the importance ratio's denominator,
  and ``raw_logprobs`` against a trainer computing at the sampling temperature (or the
  reverse) skews every ratio;
- **untied embeddings**: on a reload vLLM keeps a tied model's old LM head (see
  ``libra.trainer._weights``), so the server must run on an untied folder.

vLLM reports its whole config at ``/server_info`` (dev mode only).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

__all__ = ["AttachError", "check_attached", "problems_of"]


class AttachError(RuntimeError):
    """An attached server cannot take part in training as it runs."""


async def check_attached(urls: Sequence[str], logprobs_mode: str, timeout_s: float = 30.0) -> None:
    """Raise :class:`AttachError` listing what is wrong with any of ``urls``."""
    problems: list[str] = []
    async with httpx.AsyncClient(timeout=timeout_s) as client:
        for url in urls:
            info = await _server_info(client, url.rstrip("/"))
            if info is None:
                problems.append(
                    f"{url} is not a vLLM server in dev mode (no /server_info): start it with "
                    "VLLM_SERVER_DEV_MODE=1, which weight reloads need"
                )
                continue
            problems += [f"{url} {problem}" for problem in problems_of(info, logprobs_mode)]
    if problems:
        raise AttachError("; ".join(problems))


async def _server_info(client: httpx.AsyncClient, url: str) -> dict[str, Any] | None:
    try:
        response = await client.get(f"{url}/server_info", params={"config_format": "json"})
    except httpx.HTTPError as error:
        raise AttachError(f"{url} did not answer /server_info: {error!r}") from error
    if response.status_code != 200:
        return None
    info: dict[str, Any] = response.json()
    return info


def problems_of(info: dict[str, Any], logprobs_mode: str) -> list[str]:
    """What in a server's ``/server_info`` rules it out for training (empty: nothing)."""
    model = info.get("vllm_config", {}).get("model_config", {})
    problems = []
    if model.get("logprobs_mode") != logprobs_mode:
        problems.append(
            f"runs with --logprobs-mode {model.get('logprobs_mode')}, the loop expects "
            f"{logprobs_mode} (set logprobs_mode to match, or restart the server)"
        )
    if _tied(Path(str(model.get("model", "")))):
        problems.append(
            f"serves {model.get('model')}, whose embeddings are tied: a reload would keep its "
            "old LM head; serve an untied copy (libra.trainer.servable_model writes one)"
        )
    return problems


def _tied(folder: Path) -> bool:
    """Whether the folder's config ties the embeddings (False when it cannot be read
    from here: the server may run on another machine)."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return bool(config.get("tie_word_embeddings", False))
