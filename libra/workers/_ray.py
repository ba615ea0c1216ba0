"""The Ray backend of the cluster: the same operations as the local one, with the vLLM
servers and the FSDP ranks as Ray actors.

Each worker is one bundle of a placement group held for the cluster's life: a GPU (with
a CPU) on a GPU cluster, its cores' count of CPUs otherwise. Whatever runs on a worker
is an actor scheduled into the worker's bundle, so a worker's trainer rank and its vLLM
server land on the same accelerator, and no other worker's actor can. An actor asks for
half its bundle: while the trainer's world changes (``_elastic``), the old world's rank
and the next world's rank of the same worker live side by side until the switch.

- :class:`RayTrainer` is one world of FSDP ranks, one actor each, with the interface of
  :class:`~libra.trainer._worker.TrainerProcess`: rank 0's actor names its address and a free
  port, every rank joins the process group there (gloo on CPU, NCCL on CUDA, as
  ``_fsdp`` chooses), every rank runs each command, rank 0's result is the answer. A rank
  pins itself to its worker's cores when they are given (on CPU).
- :class:`RayServer` is a serving instance: an actor that owns a :class:`VLLMServer`.
- :func:`open_ray_workers` starts a local Ray instance or attaches to a cluster, and
  holds the workers' bundles.

Ray's waits run in worker threads (``anyio.to_thread``), so the event loop stays free and
the core stays backend-neutral (asyncio or trio). What every rank reads, the model folder
and the handover's scratch folder (``_elastic``), must be at the same path on every node:
one machine, or a shared file system.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import socket
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import ExitStack, asynccontextmanager, contextmanager
from functools import cache, partial
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, Self, TypeVar

import anyio

from libra.config import UsageError
from libra.serving import VLLMServer, VLLMServerConfig
from libra.trainer._worker import TrainerCommand, TrainerError

if TYPE_CHECKING:
    from libra.trainer._fsdp import FSDPTrainer, TrainerConfig

T = TypeVar("T")

#: The share of its worker's bundle an actor asks for: two fit, the old world's rank
#: and the next one's during a resize.
_SHARE = 0.5
# After a rank's command fails, how long the other ranks' answers are awaited to learn
# whether a rank died (a peer's death makes the survivors' collectives fail).
_DEATH_WAIT_S = 10.0
_EXIT_POLL_S = 2.0  # how often a supervised Ray server is asked whether it runs
_STOP_WAIT_S = 60.0
_RAY_HINT = "Ray is not installed: pip install 'libra[ray]' (or `ray==2.60.0`)"


def ray_missing() -> str | None:
    """Why the Ray backend cannot run here, or None."""
    return None if importlib.util.find_spec("ray") is not None else _RAY_HINT


def _not_the_sigterm_warning(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("SIGTERM handler is not set")


def import_ray() -> Any:
    """The ``ray`` module, or a :class:`UsageError` that says how to install it."""
    try:
        import ray
    except ImportError as missing:
        raise UsageError(f"alloc.backend = 'ray': {_RAY_HINT}") from missing
    return ray


# ------------------------------------------------------------------------ actors


class RankActor:
    """One FSDP rank in a Ray actor (made remote by :func:`_rank_class`)."""

    def __init__(self, rank: int, world_size: int, cores: tuple[int, ...] | None) -> None:
        self.rank, self.world_size, self.cores = rank, world_size, cores
        self.trainer: FSDPTrainer | None = None
        self.threads = 1
        self._parked = threading.Event()

    def rendezvous(self) -> tuple[str, int]:
        """Rank 0's address and a free port on it: where the process group meets."""
        import ray

        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind(("", 0))
            port: int = probe.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def load(self, where: tuple[str, int], model_dir: Path, config: TrainerConfig) -> None:
        """Join the process group at ``where`` and load the model, sharded."""
        import torch

        from libra.trainer._fsdp import FSDPTrainer

        address, port = where
        # One accelerator per actor (Ray sets what it sees), so the local rank is 0.
        os.environ.update(
            RANK=str(self.rank),
            WORLD_SIZE=str(self.world_size),
            LOCAL_RANK="0",
            LOCAL_WORLD_SIZE="1",
            MASTER_ADDR=address,
            MASTER_PORT=str(port),
        )
        if self.cores is not None:
            os.sched_setaffinity(0, self.cores)
            config = config.model_copy(update={"cpu_threads": len(self.cores)})
        self.trainer = FSDPTrainer(model_dir, config)
        self.threads = torch.get_num_threads()

    def run(self, command: TrainerCommand[T]) -> T:
        import torch

        assert self.trainer is not None, "load() first"
        # A threaded actor may run each call on another thread than load(): give it the
        # torch threads the trainer chose there (OpenMP's count is per thread).
        torch.set_num_threads(self.threads)
        return command.run(self.trainer)

    def pid(self) -> int:
        return os.getpid()

    def park(self) -> None:
        """Return never: the caller's wait on it ends when the actor dies."""
        self._parked.wait()


class ServerActor:
    """A vLLM server owned by a Ray actor (made remote by :func:`_server_class`): when
    the actor dies, the server's guard stops the server's whole tree (``_vllm``)."""

    def __init__(self, model: Path, served_model_name: str, config: VLLMServerConfig) -> None:
        self.server = VLLMServer(model, served_model_name=served_model_name, config=config)

    def start(self) -> tuple[str, Path | None]:
        """Start the server; its URL as the driver reaches it, and its log file."""
        import ray

        self.server.start()
        host = self.server.config.host
        if host in ("0.0.0.0", "::"):  # listening on every interface: the node's address
            host = ray.util.get_node_ip_address()
        return f"http://{host}:{self.server.port}", self.server.log_file

    def reload_weights_from(self, folder: Path, timeout_s: float) -> None:
        self.server.reload_weights_from(folder, timeout_s)

    def stop(self) -> None:
        self.server.stop()

    def is_running(self) -> bool:
        return self.server.is_running


@cache
def _rank_class() -> Any:
    # Threaded: ``park`` waits beside the commands (which the world runs one at a time).
    return import_ray().remote(max_concurrency=2)(RankActor)


@cache
def _server_class() -> Any:
    return import_ray().remote(ServerActor)


async def _ray_get(refs: Any, timeout_s: float | None = None) -> Any:
    ray = import_ray()
    get = partial(ray.get, refs, timeout=timeout_s)
    return await anyio.to_thread.run_sync(get, abandon_on_cancel=True)


# -------------------------------------------------------------------- the world


class _RankEnded(Exception):
    """A rank's call ended in error: ``died`` (its actor is gone), or it raised."""

    def __init__(self, rank: int, *, died: bool, detail: str) -> None:
        super().__init__(rank, died, detail)
        self.rank, self.died, self.detail = rank, died, detail


class RayTrainer:
    """One world of FSDP ranks as Ray actors, rank ``r`` started with ``placements[r]``
    (Ray actor options: its worker's bundle and share) and pinned to ``cores[r]`` when
    given. The interface is :class:`~libra.trainer._worker.TrainerProcess`'s: a rank whose
    actor dies makes :meth:`call` and :meth:`watch` raise ``trainer rank N died ...``."""

    def __init__(
        self,
        model_dir: Path,
        config: TrainerConfig,
        placements: Sequence[dict[str, Any]],
        cores: Sequence[tuple[int, ...]] | None = None,
    ) -> None:
        if cores is not None and len(cores) != len(placements):
            raise ValueError(f"{len(cores)} core sets for {len(placements)} ranks")
        self.model_dir, self.config = model_dir, config
        self.placements = list(placements)
        self.cores = [tuple(c) for c in cores] if cores is not None else None
        self._actors: list[Any] = []
        self._loading: list[Any] = []
        self._parked: list[Any] = []
        self._ended: TrainerError | None = None
        self._died = False
        self._loaded = anyio.Lock()

    @property
    def world_size(self) -> int:
        return len(self.placements)

    async def __aenter__(self) -> Self:
        """Start the actors and have them load (the wait is :meth:`ready`'s)."""
        rank_class = _rank_class()
        for rank, options in enumerate(self.placements):
            mine = self.cores[rank] if self.cores is not None else None
            actor = rank_class.options(**options).remote(rank, self.world_size, mine)
            self._actors.append(actor)
        where = self._actors[0].rendezvous.remote()  # resolved by Ray before each load
        self._loading = [a.load.remote(where, self.model_dir, self.config) for a in self._actors]
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._kill()

    def _kill(self) -> None:
        ray = import_ray()
        for actor in self._actors:
            ray.kill(actor, no_restart=True)

    async def ready(self) -> None:
        """Wait until every rank has joined the group and loaded the model."""
        async with self._loaded:  # watch() and the first call may both wait here
            if self._loading:
                await self._gather(self._loading)
                self._loading = []
                self._parked = [actor.park.remote() for actor in self._actors]

    async def call(self, command: TrainerCommand[T]) -> T:
        """Run ``command`` on every rank; rank 0's result."""
        await self.ready()
        shared = import_ray().put(command)  # sent once, read by every rank
        results = await self._gather([actor.run.remote(shared) for actor in self._actors])
        result: T = results[0]
        return result

    async def call_sized(self, make: Callable[[int], TrainerCommand[T] | None]) -> T | None:
        command = make(self.world_size)
        return None if command is None else await self.call(command)

    async def watch(self) -> None:
        """Return never while the ranks live; raise :class:`TrainerError` as soon as one
        dies. (A rank that raised is :meth:`call`'s to report: the ranks it stopped are
        no death.)"""
        await self.ready()
        rank = await anyio.to_thread.run_sync(self._first_death, abandon_on_cancel=True)
        error = self._end(_RankEnded(rank, died=True, detail="its actor died"))
        if self._died:
            raise error
        await anyio.sleep_forever()

    def _first_death(self) -> int:
        ray = import_ray()
        done, _ = ray.wait(self._parked, num_returns=1)
        return self._parked.index(done[0])

    async def _gather(self, refs: list[Any]) -> list[Any]:
        if self._ended is not None:
            raise self._ended
        try:
            return await anyio.to_thread.run_sync(partial(_wait_all, refs), abandon_on_cancel=True)
        except _RankEnded as ended:
            raise self._end(ended) from None

    def _end(self, ended: _RankEnded) -> TrainerError:
        """The error every later call raises too; the ranks left are stopped (they may be
        waiting in a collective for the one that ended)."""
        if self._ended is None:
            self._died = ended.died
            self._kill()
            how = "died" if ended.died else "failed"
            message = f"trainer rank {ended.rank} {how} ({ended.detail})"
            if not ended.died:
                message = f"the trainer failed: {message}"
            self._ended = TrainerError(message)
        return self._ended


def _wait_all(refs: list[Any]) -> list[Any]:
    """Every rank's answer, in rank order; the first rank to end in error raises
    :class:`_RankEnded` (a death reported before a failure it caused)."""
    ray = import_ray()
    answers: dict[int, Any] = {}
    pending = list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        rank = refs.index(done[0])
        try:
            answers[rank] = ray.get(done[0])
        except ray.exceptions.RayActorError as died:
            raise _RankEnded(rank, died=True, detail=_first_line(died)) from None
        except ray.exceptions.RayTaskError as failed:
            raise _death_among(pending, refs) or _RankEnded(
                rank, died=False, detail=str(failed)
            ) from None
    return [answers[rank] for rank in range(len(refs))]


def _death_among(pending: list[Any], refs: list[Any]) -> _RankEnded | None:
    ray = import_ray()
    done, _ = ray.wait(pending, num_returns=len(pending), timeout=_DEATH_WAIT_S)
    for ref in done:
        try:
            ray.get(ref)
        except ray.exceptions.RayActorError as died:
            return _RankEnded(refs.index(ref), died=True, detail=_first_line(died))
        except ray.exceptions.RayTaskError:
            continue
    return None


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0].rstrip(".") if lines else type(error).__name__


# ------------------------------------------------------------------- serving


class RayServer:
    """A serving instance: a :class:`ServerActor` in its first worker's bundle (an
    instance over several workers: in the first one's, the others' held by the group)."""

    def __init__(
        self, model: Path, served_model_name: str, config: VLLMServerConfig, options: dict[str, Any]
    ) -> None:
        self.model, self.served_model_name, self.config = model, served_model_name, config
        self.options = options
        self._actor: Any = None
        self._url: str | None = None
        self._log_file: Path | None = None

    @property
    def url(self) -> str:
        if self._url is None:
            raise RuntimeError("the instance has not been started")
        return self._url

    @property
    def log_file(self) -> Path | None:
        """On the node that runs it."""
        return self._log_file

    async def astart(self) -> None:
        actor_class = _server_class()
        self._actor = actor_class.options(**self.options).remote(
            self.model, self.served_model_name, self.config
        )
        try:
            self._url, self._log_file = await _ray_get(self._actor.start.remote())
        except BaseException:
            self._kill()  # its guard stops the server's tree as the actor dies
            raise

    async def areload_weights_from(
        self, weights_path: str | Path, timeout_s: float = 300.0
    ) -> None:
        await _ray_get(self._actor.reload_weights_from.remote(Path(weights_path), timeout_s))

    async def astop(self) -> None:
        if self._actor is None:
            return
        try:
            # The server's own stop is bounded (grace, then SIGKILL); past that, the kill
            # below ends the actor, and its server's guard the server's tree.
            with anyio.move_on_after(_STOP_WAIT_S, shield=True):
                await _ray_get(self._actor.stop.remote())
        finally:
            self._kill()

    async def wait_exited(self) -> None:
        """Return once the server or its actor is gone (polled: an actor's server may
        run on another node, so there is no process to wait on here)."""
        while self._actor is not None:
            try:
                if not await _ray_get(self._actor.is_running.remote()):
                    return
            except Exception:  # the actor died with it (Ray's RayActorError)
                return
            await anyio.sleep(_EXIT_POLL_S)

    def _kill(self) -> None:
        if self._actor is not None:
            import_ray().kill(self._actor, no_restart=True)
            self._actor = None


# ------------------------------------------------------------------- the workers


class RayWorkers:
    """The cluster's workers on Ray: ``cores[w]`` is worker ``w``'s CPU cores (a CPU
    cluster: the bundle holds that many CPUs, its actors pin themselves to them), or one
    GPU each when ``gpus``."""

    def __init__(self, cores: Sequence[tuple[int, ...]], *, gpus: bool) -> None:
        self.cores, self.gpus = [tuple(c) for c in cores], gpus
        self._group: Any = None

    def bundles(self) -> list[dict[str, float]]:
        if self.gpus:
            return [{"GPU": 1, "CPU": 1} for _ in self.cores]
        return [{"CPU": float(len(cores))} for cores in self.cores]

    async def __aenter__(self) -> Self:
        from ray.util.placement_group import placement_group

        self._group = placement_group(self.bundles(), strategy="PACK", name="libra-workers")
        try:
            await _ray_get(self._group.ready())
        except BaseException:
            self._remove()
            raise
        return self

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
) -> AsyncIterator[RayWorkers]:
    """Ray (already initialized in this process; else started here when ``address`` is
    None, attached to otherwise) with a bundle per worker: GPUs when the trainer's
    ``backend`` is NCCL (``auto``: when the cluster has GPUs). A Ray started or attached
    here is shut down on exit."""
    ray = import_ray()
    with ExitStack() as ray_here:
        if not ray.is_initialized():
            await anyio.to_thread.run_sync(ray_here.enter_context, ray_started(cores, address))
        gpus = backend == "nccl" or (
            backend == "auto" and ray.cluster_resources().get("GPU", 0) >= 1
        )
        async with RayWorkers(cores, gpus=gpus) as workers:
            yield workers


@contextmanager
def ray_started(cores: Sequence[tuple[int, ...]], address: str | None) -> Iterator[None]:
    """Ray started (``address`` None) or attached to, from a thread of its own that lives
    until Ray is shut down on exit.

    Ray's head processes (its GCS and raylet) ask Linux to kill them when the *thread*
    that started them exits (``PR_SET_PDEATHSIG``, as ``_vllm`` notes for the guard). From
    one of anyio's worker threads, which exit after 10 s idle or with their event loop,
    that killed the head mid-run, and this process with it: Ray's driver exits with
    status 1 and no word when its raylet dies. Not the main thread either: see
    :func:`_init_ray`."""
    ray = import_ray()
    started: Future[None] = Future()
    stop = threading.Event()

    def hold_ray() -> None:
        try:
            _init_ray(ray, cores, address)
        except BaseException as error:
            started.set_exception(error)
            return
        started.set_result(None)
        stop.wait()  # Ray's head lives as long as this thread

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


def _init_ray(ray: Any, cores: Sequence[tuple[int, ...]], address: str | None) -> None:
    # Called off the main thread on purpose: from the main thread Ray installs a SIGTERM
    # handler that exits the process, where `libra train` stops its servers and ranks
    # itself. Ray warns that it did not; the warning is about that choice, so it is muted.
    logging.getLogger("ray._private.worker").addFilter(_not_the_sigterm_warning)
    # Ray's workers import this checkout's libra (and whatever the driver imports).
    here = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
    runtime_env = {"env_vars": {"PYTHONPATH": path}}
    if address is not None:
        ray.init(address=address, runtime_env=runtime_env)
        return
    # As many CPUs as the workers' core sets hold (they may share cores on a small
    # machine), and at least the machine's.
    cpus = max(os.cpu_count() or 1, sum(len(c) for c in cores))
    ray.init(num_cpus=cpus, include_dashboard=False, runtime_env=runtime_env)
