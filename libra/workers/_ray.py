"""The Ray backend of the cluster: the same operations as the local one, with the vLLM
servers and the FSDP ranks as Ray actors. This module holds what they share: whether Ray
is here, and a wait on Ray that leaves the event loop free.

Each worker is one bundle of a placement group held for the cluster's life: a GPU (with
a CPU) on a GPU cluster, its cores' count of CPUs otherwise. Whatever runs on a worker
is an actor scheduled into the worker's bundle, so a worker's trainer rank and its vLLM
server land on the same accelerator, and no other worker's actor can. A worker's bundle is
held on a node its label selector allows, when it has one (``alloc.ray_labels``): that is
how a run says which node each worker is on. An actor asks for
half its bundle: while the trainer's world changes (``_elastic``), the old world's rank
and the next world's rank of the same worker live side by side until the switch.

- :class:`RayTrainer` (``_ray_trainer``) is one world of FSDP ranks, one actor each, with
  the interface of :class:`~libra.trainer.TrainerProcess`: rank 0's actor names its
  address and a free port, every rank joins the process group there (gloo on CPU, NCCL
  on CUDA, as ``libra.trainer`` chooses), every rank runs each command, rank 0's result
  is the answer. A rank pins itself to its worker's cores when they are given (on CPU).
- :class:`RayServer` (``_ray_server``) is a serving instance: an actor that owns a
  :class:`VLLMServer`.
- :func:`open_ray_workers` (``_ray_workers``) starts a local Ray instance or attaches to
  a cluster, and holds the workers' bundles.

Ray's waits run in worker threads (``anyio.to_thread``), so the event loop stays free and
the core stays backend-neutral (asyncio or trio). What every rank reads, the model folder
and the handover's scratch folder (``_elastic``), must be at the same path on every node:
one machine, or a shared file system.
"""

from __future__ import annotations

import importlib.util
from functools import partial
from typing import TYPE_CHECKING, Any

import anyio

from libra.config import UsageError

if TYPE_CHECKING:
    pass


_RAY_HINT = "Ray is not installed: pip install 'libra[ray]' (or `ray==2.60.0`)"


def ray_missing() -> str | None:
    """Why the Ray backend cannot run here, or None."""
    return None if importlib.util.find_spec("ray") is not None else _RAY_HINT


def import_ray() -> Any:
    """The ``ray`` module, or a :class:`UsageError` that says how to install it."""
    try:
        import ray
    except ImportError as missing:
        raise UsageError(f"alloc.backend = 'ray': {_RAY_HINT}") from missing
    return ray


async def ray_get(refs: Any, timeout_s: float | None = None) -> Any:
    ray = import_ray()
    get = partial(ray.get, refs, timeout=timeout_s)
    return await anyio.to_thread.run_sync(get, abandon_on_cancel=True)
