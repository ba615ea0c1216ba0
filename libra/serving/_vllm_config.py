"""How a vLLM server runs: its settings, and the command line and environment they make."""

from __future__ import annotations

import functools
import importlib.metadata
import os
import secrets
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from pydantic import Field

from libra.config import Section

_API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"


class VLLMServerError(RuntimeError):
    """The vLLM server failed to start, died, or refused a control request."""


class VLLMServerConfig(Section):
    """How to run one vLLM server (everything but the model)."""

    host: str = Field(default="127.0.0.1", description="the address it listens on (its URL's host)")
    port: int = Field(default=0, ge=0, le=65535, description="0 picks a free port at start")
    threads: int | None = Field(
        default=None, ge=1, description="OMP_NUM_THREADS for the server; None leaves vLLM's"
    )
    cpu_threads_bind: str | None = Field(
        default=None,
        description="VLLM_CPU_OMP_THREADS_BIND: 'auto', 'nobind' or core ids like '0-1'",
    )
    kv_cache_gib: int = Field(default=2, ge=1, description="VLLM_CPU_KVCACHE_SPACE, in GiB")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        default="auto",
        description="--dtype the weights are served in; auto: vLLM's choice, the model "
        "folder's dtype (a float32 folder's in 16 bits). A run's own server: its export_dtype",
    )
    enforce_eager: bool | None = Field(
        default=None,
        description="skip torch.compile and CUDA graphs. None: on with vLLM's CPU build "
        "(engine init ~1 s instead of 70-130 s on 2 cores), off with its GPU build",
    )
    max_model_len: int | None = Field(
        default=None,
        ge=1,
        description="--max-model-len: a request's prompt + output tokens; None: the model's",
    )
    tensor_parallel_size: int = Field(default=1, ge=1, description="GPUs per server (CUDA)")
    gpu_memory_utilization: float | None = Field(
        default=None, gt=0, le=1, description="share of each GPU's memory vLLM takes (CUDA)"
    )
    tool_call_parser: str | None = Field(
        default=None, description="enables --enable-auto-tool-choice with this parser"
    )
    scheduling_policy: Literal["fcfs", "priority"] = Field(
        default="fcfs",
        description="--scheduling-policy: priority serves requests by the priority each "
        "carries (cmlfq.priority); fcfs by arrival",
    )
    seed: int | None = Field(
        default=None,
        ge=0,
        description="--seed of the server's sampling stream; None: a fresh one at each start. "
        "vLLM's default is 0 for every server, and servers that get the same requests in the "
        "same order then sample the same tokens: a group spread over them collapses",
    )
    dev_mode: bool = Field(
        default=False, description="VLLM_SERVER_DEV_MODE=1: /collective_rpc (weight reloads)"
    )
    extra_args: tuple[str, ...] = Field(
        default=(), description="more vLLM command-line arguments, appended as given"
    )
    extra_env: dict[str, str] = Field(
        default_factory=dict,
        description="more environment variables for the server, set last (they win)",
    )
    python_executable: Path | None = Field(
        default=None, description="interpreter that has vllm installed; default: this one"
    )
    log_file: Path | None = Field(
        default=None, description="default: $LIBRA_HOME/logs/vllm-NAME-PORT.log"
    )
    startup_timeout_s: float = Field(
        default=300.0,
        gt=0,
        description="seconds a starting server has to answer /health, else it fails",
    )
    stop_grace_s: float = Field(
        default=10.0, gt=0, description="SIGTERM to SIGKILL delay when stopping"
    )


def vllm_command(
    config: VLLMServerConfig, model: str, served_model_name: str, port: int
) -> list[str]:
    """The vLLM command line that serves ``model`` on ``port``."""
    python = str(config.python_executable or sys.executable)
    args = [python, "-m", _API_SERVER_MODULE, "--model", model]
    args += ["--served-model-name", served_model_name]
    args += ["--host", config.host, "--port", str(port), "--dtype", config.dtype]
    args.append("--no-use-tqdm-on-load")  # a log file, not a terminal: no progress bars
    if config.enforce_eager or (config.enforce_eager is None and not _gpu_build()):
        args.append("--enforce-eager")
    if config.max_model_len is not None:
        args += ["--max-model-len", str(config.max_model_len)]
    if config.tensor_parallel_size > 1:
        args += ["--tensor-parallel-size", str(config.tensor_parallel_size)]
    if config.gpu_memory_utilization is not None:
        args += ["--gpu-memory-utilization", str(config.gpu_memory_utilization)]
    if config.scheduling_policy != "fcfs":
        args += ["--scheduling-policy", config.scheduling_policy]
    if config.tool_call_parser is not None:
        args += ["--enable-auto-tool-choice", "--tool-call-parser", config.tool_call_parser]
    seed = secrets.randbelow(2**31) if config.seed is None else config.seed
    args += ["--seed", str(seed)]
    return args + list(config.extra_args)


@functools.cache
def _gpu_build() -> bool:
    """Whether the vLLM beside Libra is its GPU build: ``vllm``, where the CPU build is
    ``vllm-cpu`` (a server under another ``python_executable`` is assumed alike)."""
    try:
        importlib.metadata.distribution("vllm")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def vllm_environment(
    config: VLLMServerConfig, model: str, base: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The server's environment: ``base`` (default ``os.environ``) plus vLLM settings."""
    env = dict(os.environ if base is None else base)
    env["VLLM_CPU_KVCACHE_SPACE"] = str(config.kv_cache_gib)
    if config.tensor_parallel_size == 1 and config.cpu_threads_bind is None:
        # One process fewer: on CPU, vLLM runs its one worker in a process of its own
        # unless this is off (the API server still runs the engine core apart). It
        # starts ~10 s sooner on 2 cores, and a GPU server at tp 1 runs it so already.
        # Not for a server bound to cores: vLLM binds threads only in a worker's process.
        env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if config.threads is not None:
        env["OMP_NUM_THREADS"] = str(config.threads)
    if config.cpu_threads_bind is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = config.cpu_threads_bind
    if config.dev_mode:
        env["VLLM_SERVER_DEV_MODE"] = "1"
    # Unbuffered, so the log tail in an error shows the server's last words.
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    if Path(model).is_dir():
        # A local folder needs no hub; lookups on an offline machine would only wait.
        env.setdefault("HF_HUB_OFFLINE", "1")
    env.update(config.extra_env)
    return env


# The ranks vLLM (0.32) accepts for --max-lora-rank: an adapter's rank may be lower.
_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def with_lora_adapter(
    config: VLLMServerConfig, name: str, adapter: Path, rank: int
) -> VLLMServerConfig:
    """``config`` for a server that serves the LoRA adapter in ``adapter`` under ``name``
    (beside its base model) and loads new versions of it at runtime
    (``libra.serving.WeightSync``)."""
    fits = [allowed for allowed in _MAX_LORA_RANKS if allowed >= rank]
    if not fits:
        raise VLLMServerError(f"vLLM serves LoRA ranks up to {_MAX_LORA_RANKS[-1]}, not {rank}")
    args: tuple[str, ...] = ("--enable-lora", "--max-lora-rank", str(fits[0]), "--max-loras", "1")
    args += ("--lora-modules", f"{name}={adapter}")
    env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    return config.model_copy(
        update={
            "extra_args": (*config.extra_args, *args),
            "extra_env": {**config.extra_env, **env},
        }
    )
