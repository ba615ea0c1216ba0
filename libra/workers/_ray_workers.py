"""The cluster's workers on Ray: Ray started or attached to, and a placement group that
holds a bundle per worker, where each worker's ranks and servers run (see ``_ray``)."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from contextlib import ExitStack, asynccontextmanager, contextmanager
from functools import partial
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, Self

import anyio

from libra.config import UsageError
from libra.serving import VLLMServerConfig

if TYPE_CHECKING:
    from libra.trainer import TrainerConfig

from libra.workers._ray import import_ray
from libra.workers._ray_head import ray_head
from libra.workers._ray_server import RayServer
from libra.workers._ray_trainer import RayTrainer

#: The share of its worker's bundle an actor asks for: two fit, the old world's rank
#: and the next one's during a resize.
_SHARE = 0.5
#: Seconds between two lines while Ray has not placed every worker yet.
_PLACING_POLL_S = 30.0

_log = logging.getLogger(__name__)


def _own_labels(labels: Mapping[str, str]) -> dict[str, str]:
    """A node's labels without those Ray sets on every node (``ray.io/...``)."""
    return {key: value for key, value in labels.items() if not key.startswith("ray.io/")}


def _not_the_sigterm_warning(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("SIGTERM handler is not set")


class RayWorkers:
    """The cluster's workers on Ray: ``cores[w]`` is worker ``w``'s CPU cores (a CPU
    cluster: the bundle holds that many CPUs, its actors pin themselves to them), or one
    GPU each when ``gpus``. ``labels[w]`` (when given) is the label selector of the node
    that is to hold worker ``w``'s bundle, and so its ranks and servers. Ray holds none
    until it can hold all: past ``wait_s`` the run stops with what is missing."""

    def __init__(
        self,
        cores: Sequence[tuple[int, ...]],
        *,
        gpus: bool,
        labels: Sequence[Mapping[str, str]] = (),
        wait_s: float = 600.0,
    ) -> None:
        if labels and len(labels) != len(cores):
            raise ValueError(f"{len(labels)} label selectors for {len(cores)} workers")
        self.cores, self.gpus = [tuple(c) for c in cores], gpus
        self.labels = [dict(selector) for selector in labels]
        self.wait_s = wait_s
        self._group: Any = None

    def bundles(self) -> list[dict[str, float]]:
        if self.gpus:
            return [{"GPU": 1, "CPU": 1} for _ in self.cores]
        return [{"CPU": float(len(cores))} for cores in self.cores]

    async def __aenter__(self) -> Self:
        from ray.util.placement_group import placement_group

        # PACK still applies among the nodes a bundle's selector allows (Ray's selectors
        # are hard constraints: a bundle no node matches waits for one to join).
        self._group = placement_group(
            self.bundles(),
            strategy="PACK",
            name="libra-workers",
            bundle_label_selector=self.labels or None,
        )
        try:
            await self._placed()
        except BaseException:
            self._remove()
            raise
        return self

    async def _placed(self) -> None:
        """Wait until Ray holds every bundle, saying what it waits for every
        :data:`_PLACING_POLL_S`: a selector no node matches, or a bundle larger than any
        node, waits for a node that has them to join (an autoscaler's may)."""
        waited = 0.0
        while True:
            poll = min(_PLACING_POLL_S, self.wait_s - waited)
            wait = partial(self._group.wait, timeout_seconds=poll)
            if await anyio.to_thread.run_sync(wait, abandon_on_cancel=True):
                return
            waited += poll
            unplaced = await anyio.to_thread.run_sync(self._unplaced, waited)
            if waited >= self.wait_s:
                raise UsageError(f"{unplaced} (alloc.ray_wait_s = {self.wait_s:g})")
            _log.warning("%s; waiting up to alloc.ray_wait_s = %g s", unplaced, self.wait_s)

    def _unplaced(self, waited: float) -> str:
        """What Ray has not placed after ``waited`` seconds, and the nodes it has."""
        nodes = [node for node in import_ray().nodes() if node["Alive"]]
        bundles = [
            f"w{worker} {bundle}" + (f" on {self.labels[worker]}" if self.labels else "")
            for worker, bundle in enumerate(self.bundles())
        ]
        have = [
            f"{_own_labels(node['Labels'])} CPU {node['Resources'].get('CPU', 0):g}"
            + (f" GPU {gpus:g}" if (gpus := node["Resources"].get("GPU", 0)) else "")
            for node in nodes
        ]
        return (
            f"Ray has not placed the workers after {waited:g} s: {'; '.join(bundles)}. "
            f"Its nodes: {'; '.join(have) or 'none alive'}"
        )

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._remove()

    def _remove(self) -> None:
        from ray.util.placement_group import remove_placement_group

        if self._group is not None:
            remove_placement_group(self._group)
            self._group = None

    def options(self, worker: int) -> dict[str, Any]:
        """Ray actor options for something running on ``worker``: its share of the
        worker's bundle."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = self.bundles()[worker]
        return {
            "num_cpus": bundle["CPU"] * _SHARE,
            "num_gpus": bundle.get("GPU", 0) * _SHARE,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=self._group, placement_group_bundle_index=worker
            ),
        }

    def worlds(
        self, model_dir: Path, config: TrainerConfig
    ) -> Callable[[tuple[int, ...]], RayTrainer]:
        """The elastic trainer's world factory: ranks on the given workers, in order."""

        def world(members: tuple[int, ...]) -> RayTrainer:
            cores = None if self.gpus else [self.cores[m] for m in members]
            return RayTrainer(model_dir, config, [self.options(m) for m in members], cores)

        return world

    def server(
        self,
        model: Path,
        served_model_name: str,
        config: VLLMServerConfig,
        workers: tuple[int, ...],
    ) -> RayServer:
        """The cluster's ``start_server``: a vLLM server in an actor on ``workers``."""
        if self.gpus:
            if len(workers) > 1:
                raise ValueError("on GPUs the Ray backend serves one worker per instance (TP 1)")
            config = config.model_copy(update={"cpu_threads_bind": None, "threads": None})
        return RayServer(model, served_model_name, config, self.options(workers[0]))


@asynccontextmanager
async def open_ray_workers(
    cores: Sequence[tuple[int, ...]],
    backend: Literal["auto", "gloo", "nccl"],
    address: str | None,
    labels: Sequence[Mapping[str, str]] = (),
    wait_s: float = 600.0,
) -> AsyncIterator[RayWorkers]:
    """Ray (already initialized in this process; else started here when ``address`` is
    None, attached to otherwise) with a bundle per worker, on a node ``labels[w]``
    selects when given: GPUs when the trainer's ``backend`` is NCCL (``auto``: when the
    cluster has GPUs). A Ray started or attached here is shut down on exit."""
    ray = import_ray()
    with ExitStack() as ray_here:
        if not ray.is_initialized():
            await anyio.to_thread.run_sync(ray_here.enter_context, ray_started(cores, address))
        gpus = backend == "nccl" or (
            backend == "auto" and ray.cluster_resources().get("GPU", 0) >= 1
        )
        async with RayWorkers(cores, gpus=gpus, labels=labels, wait_s=wait_s) as workers:
            yield workers


@contextmanager
def ray_started(cores: Sequence[tuple[int, ...]], address: str | None) -> Iterator[None]:
    """Ray started (``address`` None) or attached to, from a thread of its own that lives
    until Ray is shut down on exit.

    A head started here asks Linux to stop it when the *thread* that started it exits
    (``PR_SET_PDEATHSIG``, as ``_vllm`` notes for the guard). One of anyio's worker
    threads exits after 10 s idle or with its event loop, which would stop the head
    mid-run, and this process with it: Ray's driver exits with status 1 and no word when
    its raylet dies. Not the main thread either: see :func:`_init_ray`."""
    ray = import_ray()
    started: Future[None] = Future()
    stop = threading.Event()

    def hold_ray() -> None:
        try:
            head = _init_ray(ray, cores, address)
        except BaseException as error:
            started.set_exception(error)
            return
        started.set_result(None)
        with head:
            stop.wait()  # Ray lives as long as this thread

    holder = threading.Thread(target=hold_ray, name="libra-ray", daemon=True)
    holder.start()
    started.result()
    try:
        yield
    finally:
        try:
            ray.shutdown()
        finally:
            stop.set()
            holder.join()


def _init_ray(ray: Any, cores: Sequence[tuple[int, ...]], address: str | None) -> ExitStack:
    """Ray attached to at ``address``, or to a head started here (see ``_ray_head``); the
    stack returned stops that head."""
    # Called off the main thread on purpose: from the main thread Ray installs a SIGTERM
    # handler that exits the process, where `libra train` stops its servers and ranks
    # itself. Ray warns that it did not; the warning is about that choice, so it is muted.
    logging.getLogger("ray._private.worker").addFilter(_not_the_sigterm_warning)
    # Ray's workers import this checkout's libra (and whatever the driver imports).
    here = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
    runtime_env = {"env_vars": {"PYTHONPATH": path}}
    head = ExitStack()
    if address is None:
        # As many CPUs as the workers' core sets hold (they may share cores on a small
        # machine), and at least the machine's.
        cpus = max(os.cpu_count() or 1, sum(len(c) for c in cores))
        address = head.enter_context(ray_head(cpus))
    with head:
        ray.init(address=address, runtime_env=runtime_env)
        return head.pop_all()
