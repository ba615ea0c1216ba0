"""The embedded model's server: Libra's vLLM defaults, and finding a running ``libra vllm``.

``libra vllm`` records the server it runs in ``$LIBRA_HOME/run/embedded.json``, so that
``--server embedded`` reuses it instead of starting (and stopping) a server of its own.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from libra._home import libra_home
from libra.config import load_config
from libra.serving._vllm_config import VLLMServerConfig


def server_config(
    file: Path | None = None, flags: Mapping[str, Any] | None = None, overrides: Sequence[str] = ()
) -> VLLMServerConfig:
    """Libra's defaults for the vLLM servers it starts (a context that fits agentic turns,
    priority scheduling for the scheduler), under a TOML file, flags and ``--set``."""
    defaults = {"max_model_len": 8192, "scheduling_policy": "priority"}
    return load_config(VLLMServerConfig, file, flags, overrides, defaults=defaults)


def running_embedded_url() -> str | None:
    """The URL of a healthy ``libra vllm`` of the embedded model, if one runs."""
    try:
        state = json.loads(state_file().read_text())
        os.kill(int(state["pid"]), 0)
        healthy = httpx.get(state["url"] + "/health", timeout=2).status_code == 200
    except (OSError, ValueError, KeyError, httpx.HTTPError):
        return None
    return str(state["url"]) if healthy else None


def state_file() -> Path:
    run_dir = libra_home() / "run"
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir / "embedded.json"
