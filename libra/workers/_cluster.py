"""The run's cluster of workers: each worker is a set of CPU cores (a core set stands for
an accelerator) or, on Ray with GPUs, a GPU; serving instances are vLLM servers bound to
their workers, and training is the :class:`ElasticTrainer`, one rank per training
worker, pinned to its worker's cores. It is what the allocation pool drives (a
``libra.alloc.Cluster``).

Training operations, per hybrid worker: it joins the trainer's hybrid gradient group as
a one-rank replica beside the core's world, which is never rebuilt for it (see
``_hybrid``):

- ``fetch_state``: its replica starts and loads the model while the core trains;
- ``zero_sync``: between two pieces of the step under way (a run with hybrid units
  takes every step in pieces) or between steps, it enters the group's bridge,
  contributes a gradient of zeros and takes the core's parameters;
- ``activate``: it takes pieces of the step under way, or of the next;
- ``leave_training``: its replica stops at a step boundary (or, mid-fetch, at once);
  the group goes on without it. A core worker leaving rebuilds the core's world.

With ``[alloc] backend = "local"`` the servers and ranks are processes of this machine;
with ``"ray"`` they are Ray actors (``_ray``). :class:`WorkerCluster` is one class for
both, given how instances start (``start_server``) and how the trainer's worlds start
(the :class:`ElasticTrainer`'s world factory); :func:`open_cluster` picks them.
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

import anyio
from pydantic import Field, PositiveFloat, model_validator

from libra.alloc import (
    AllocationLoop,
    CallTiming,
    Demand,
    HybridPool,
    Layout,
    LoopConfig,
    Move,
    PoolConfig,
    StepTiming,
    TailLender,
    TailRule,
)
from libra.config import Section
from libra.engine import TrajectoryRecord
from libra.sched import CallOutcome, Route, Router, RouteRequest, Scheduler
from libra.serving import EMBEDDED_MODEL_NAME, ServerSupervisor, VLLMServer, VLLMServerConfig
from libra.signals import ToolSignal
from libra.trainer import TrainerConfig
from libra.workers._elastic import ElasticTrainer
from libra.workers._ray import ray_missing
from libra.workers._ray_workers import open_ray_workers

CurrentWeights = Callable[[], tuple[Path | None, int]]


class HeldServer(Protocol):
    """A serving instance as the cluster holds it: a :class:`VLLMServer` here, a Ray
    actor owning one with the Ray backend."""

    @property
    def url(self) -> str: ...

    @property
    def log_file(self) -> Path | None: ...

    async def astart(self) -> None: ...

    async def astop(self) -> None: ...

    async def wait_exited(self) -> None: ...

    async def areload_weights_from(
        self, weights_path: str | Path, timeout_s: float = ...
    ) -> None: ...


class StartServer(Protocol):
    """Builds (does not start) the instance serving ``model`` on ``workers``."""

    def __call__(
        self,
        model: Path,
        served_model_name: str,
        config: VLLMServerConfig,
        workers: tuple[int, ...],
    ) -> HeldServer: ...


def local_server(
    model: Path, served_model_name: str, config: VLLMServerConfig, workers: tuple[int, ...]
) -> VLLMServer:
    """A vLLM server in a process of this machine (its cores are in ``config``)."""
    return VLLMServer(model, served_model_name=served_model_name, config=config)


class AllocConfig(Section):
    """``[alloc]``: the run's workers, which of them move, and the loop that moves them."""

    enabled: bool = Field(
        False, description="run the allocation; false: the run is as without [alloc]"
    )
    workers: tuple[tuple[int, ...], ...] = Field(
        (),
        description="each worker's CPU cores (a core may be in several sets on a small "
        "machine); empty: one worker per core this process may run on",
    )
    training: tuple[int, ...] = Field((0,), description="core-training workers (trainer ranks)")
    rollout: tuple[tuple[int, ...], ...] = Field(
        ((1,),), description="core-rollout units: the workers of one vLLM server each"
    )
    hybrid: tuple[tuple[int, ...], ...] = Field(
        (), description="hybrid units: they serve, and the loop lends them to training"
    )
    loop: LoopConfig = Field(default_factory=LoopConfig)
    tail: TailRule | None = Field(
        None,
        description="lend the hybrid units the rollout's tail leaves idle to the training "
        "under way, and take them back when the next rollout starts; None: units move "
        "only on the loop's decisions after a step",
    )
    pool: PoolConfig = Field(default_factory=PoolConfig)
    gpu: str = Field("H100", description="the preset the planner prices a re-plan on")
    backend: Literal["local", "ray"] = Field(
        "local",
        description="local: servers and trainer ranks are processes of this machine; ray: "
        "Ray actors holding their workers' resources (pip install 'libra[ray]')",
    )
    ray_address: str | None = Field(
        None,
        description="with backend = ray: None starts a local Ray instance on this machine's "
        "cores; 'auto' or an address attaches to a running cluster",
    )
    ray_labels: tuple[dict[str, str], ...] = Field(
        (),
        description="with backend = ray: each worker's Ray label selector, the labels "
        "(`ray start --labels`) of the node that is to hold it, e.g. {node = 'a'} "
        "(Ray's syntax: also '!a', 'in(a,b)'), or {} for any node; the worker's trainer "
        "rank and vLLM server run there. Empty: Ray places every worker, on as few nodes "
        "as they fit on",
    )
    ray_wait_s: PositiveFloat = Field(
        600.0,
        description="with backend = ray: seconds to wait for Ray to hold every worker (a "
        "node a selector names, or one large enough, may still be joining) before the run "
        "stops with what is missing; a line every 30 s says what it waits for",
    )

    @model_validator(mode="after")
    def _units_are_workers(self) -> AllocConfig:
        if self.enabled and self.backend == "ray" and (missing := ray_missing()):
            raise ValueError(f"alloc.backend: {missing}")
        if self.enabled:
            self.layout().check(len(self.core_sets()))
            if not self.training:
                raise ValueError("alloc.training: the trainer needs at least one worker")
            if not self.rollout:
                raise ValueError("alloc.rollout: one unit serves whatever the loop lends")
            self._check_ray_labels()
        return self

    def _check_ray_labels(self) -> None:
        """One selector per worker, and only where Ray places the workers."""
        if not self.ray_labels:
            return
        if self.backend != "ray":
            raise ValueError("alloc.ray_labels: only Ray places workers on nodes: backend = 'ray'")
        workers = len(self.core_sets())
        if len(self.ray_labels) != workers:
            raise ValueError(
                f"alloc.ray_labels: one selector per worker ({workers}), not {len(self.ray_labels)}"
            )

    def core_sets(self) -> tuple[tuple[int, ...], ...]:
        if self.workers:
            return self.workers
        return tuple((core,) for core in sorted(os.sched_getaffinity(0)))

    def layout(self) -> Layout:
        return Layout(training=self.training, rollout=self.rollout, hybrid=self.hybrid)


@dataclass
class WorkerCluster:
    """``cores[w]``: worker ``w``'s CPU cores. Instances serve ``served_model_name``,
    started on ``base`` (the run's v0 folder) and loaded with ``weights()`` (the run's
    current folder and version) before they answer; ``weights_lock`` is held by whoever
    loads new weights into the fleet, so an instance never joins it one version behind."""

    cores: Sequence[tuple[int, ...]]
    trainer: ElasticTrainer
    base: Path
    served_model_name: str
    server: VLLMServerConfig
    weights: CurrentWeights
    weights_lock: anyio.Lock = field(default_factory=anyio.Lock)
    #: How an instance is built: a local process by default, a Ray actor with Ray.
    start_server: StartServer = local_server
    servers: dict[str, HeldServer] = field(default_factory=dict)
    #: Set once the run's engine is open: it restarts an instance that dies or hangs, and
    #: is told before one is stopped on purpose.
    supervisor: ServerSupervisor | None = None
    #: Seconds each operation took, in order: ``(what, worker or instance, seconds)``.
    timings: list[tuple[str, str, float]] = field(default_factory=list)

    @property
    def workers(self) -> int:
        return len(self.cores)

    # ---------------------------------------------------------------- serving

    async def start_instance(self, name: str, workers: tuple[int, ...]) -> str:
        if name in self.servers:
            raise ValueError(f"instance {name!r} is running already")
        started = time.perf_counter()
        cores = sorted({core for worker in workers for core in self.cores[worker]})
        config = self.server.model_copy(
            update={
                "cpu_threads_bind": ",".join(str(core) for core in cores),
                "threads": len(cores),
                "dev_mode": True,  # it is given each new version by reload
            }
        )
        server = self.start_server(self.base, self.served_model_name, config, workers)
        await server.astart()
        try:
            async with self.weights_lock:  # no sync is under way: the version is final
                folder, _ = self.weights()
                if folder is not None and folder != self.base:
                    await server.areload_weights_from(folder)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await server.astop()
            raise
        self.servers[name] = server
        if self.supervisor is not None:
            self.supervisor.watch(name, server)
        self.timings.append(("start", name, time.perf_counter() - started))
        return server.url

    async def stop_instance(self, name: str) -> None:
        if self.supervisor is not None:
            self.supervisor.unwatch(name)  # its exit is no fault to repair
        server = self.servers.pop(name, None)
        if server is not None:
            started = time.perf_counter()
            await server.astop()  # its whole process tree
            self.timings.append(("stop", name, time.perf_counter() - started))

    async def close(self) -> None:
        """Stop every instance still running."""
        with anyio.CancelScope(shield=True):
            for name in list(self.servers):
                await self.stop_instance(name)

    # ---------------------------------------------------------------- training

    async def fetch_state(self, worker: int) -> None:
        if worker in self.trainer.members:
            return  # a core-training worker: in the world from the start
        started = time.perf_counter()
        await self.trainer.fetch_replica(worker)
        self.timings.append(("fetch_state", f"w{worker}", time.perf_counter() - started))

    async def zero_sync(self, worker: int) -> None:
        if worker in self.trainer.members:
            return
        started = time.perf_counter()
        await self.trainer.sync_replica(worker)
        self.timings.append(("zero_sync", f"w{worker}", time.perf_counter() - started))

    async def activate(self, worker: int) -> None:
        if worker not in self.trainer.members:
            await self.trainer.activate_replica(worker)

    async def leave_training(self, worker: int) -> None:
        started = time.perf_counter()
        if worker in self.trainer.members:  # a core worker: its world is rebuilt
            remaining = tuple(m for m in self.trainer.members if m != worker)
            if not remaining:
                raise RuntimeError("the trainer's last worker cannot leave")
            await self.trainer.prepare(remaining)
            await self.trainer.switch()
        elif worker in self.trainer.hybrid.replicas:
            await self.trainer.drop_replica(worker)
        else:
            return
        self.timings.append(("leave", f"w{worker}", time.perf_counter() - started))


@asynccontextmanager
async def open_cluster(
    alloc: AllocConfig,
    trainer: TrainerConfig,
    model_dir: Path,
    *,
    base: Path,
    server: VLLMServerConfig,
    weights: CurrentWeights,
    weights_lock: anyio.Lock,
) -> AsyncIterator[WorkerCluster]:
    """The trainer's ranks on ``alloc.training`` (loading while the caller goes on) and a
    cluster with no instance yet, on ``alloc.backend``; on exit every instance and rank is
    stopped (and a Ray instance started here shut down)."""
    cores = alloc.core_sets()
    async with AsyncExitStack() as stack:
        start_server: StartServer = local_server
        worlds = None
        if alloc.backend == "ray":
            ray = await stack.enter_async_context(
                open_ray_workers(
                    cores, trainer.backend, alloc.ray_address, alloc.ray_labels, alloc.ray_wait_s
                )
            )
            start_server, worlds = ray.server, ray.worlds(model_dir, trainer)
        ranks = await stack.enter_async_context(
            ElasticTrainer(
                model_dir,
                trainer,
                dict(enumerate(cores)),
                members=alloc.training,
                worlds=worlds,
                in_pieces=bool(alloc.hybrid),  # a unit lent mid-step joins the step
            )
        )
        cluster = WorkerCluster(
            cores, ranks, base, EMBEDDED_MODEL_NAME, server, weights, weights_lock, start_server
        )
        try:
            yield cluster
        finally:
            await cluster.close()


# ------------------------------------------------------------------ the loop's side


@dataclass
class Allocation:
    """The run's pool and allocation loop: after each step, one decision, logged."""

    cluster: WorkerCluster
    pool: HybridPool
    loop: AllocationLoop
    tail: TailLender | None = None  # [alloc.tail]: lending inside a step's training

    def rollout_submitted(self) -> None:
        if self.tail is not None:
            self.tail.give_back()  # the rollout's servers restart beside it

    def training(
        self, positions: Callable[[], int], unfinished: Callable[[], int]
    ) -> AbstractAsyncContextManager[None]:
        return nullcontext() if self.tail is None else self.tail.training(positions, unfinished)

    def after_step(
        self,
        step: int,
        seconds: tuple[float, float],
        tokens: int,
        records: Sequence[TrajectoryRecord],
    ) -> dict[str, object]:
        """Feed the loop the step's timing and workload; what it decided and where the
        workers are, for the step's metrics line."""
        rollout_s, train_s = seconds
        timing = StepTiming(
            step=step,
            rollout_s=rollout_s,
            train_s=train_s,
            train_tokens=tokens,
            train_workers=self.cluster.trainer.world_size,
            rollout_workers=self.pool.workers_in("rollout"),
        )
        workload = Demand.of_records(records)
        decision = self.loop.on_step(timing, workload)
        return {
            "decision": decision.action,
            "reason": decision.reason,
            "ratio": round(decision.ratio, 4),
            "pressure": round(decision.pressure, 4),
            "moving": [f"{m.direction} {m.unit}" for m in decision.moves],
            "training": list(self.cluster.trainer.training),
            # The micro-batches each member took of this step (taken in pieces).
            "pieces": {
                "core" if member is None else f"w{member}": count
                for member, count in self.cluster.trainer.hybrid.shares.items()
            },
            "serving": sorted(self.cluster.servers),
            **({"lent_by_tail": self.tail.last} if self.tail is not None else {}),
            "moves": [_move_line(m) for m in self.pool.moves],  # every one so far
        }


def _move_line(move: Move) -> dict[str, object]:
    seconds = None if move.ended is None else round(move.ended - move.started, 3)
    line: dict[str, object] = {
        "unit": move.unit,
        "direction": move.direction,
        "outcome": move.outcome,
        "seconds": seconds,
    }
    if move.error:
        line["error"] = move.error
    return line


class TimedScheduler:
    """The run's scheduler, unchanged, that also times every generation call from its
    route to its release and tells ``observe`` (the allocation loop) how it went: what
    the loop learns rollout costs from. Cached tokens are not known here (0)."""

    def __init__(self, inner: Scheduler, observe: Callable[[CallTiming], None]) -> None:
        self.inner, self.observe = inner, observe
        self._sent: dict[int, tuple[float, int, int]] = {}  # id(route) -> when, prompt, calls

    @property
    def router(self) -> Router:
        return self.inner.router

    def route(self, request: RouteRequest, exclude: frozenset[str] = frozenset()) -> Route:
        route = self.inner.route(request, exclude)
        calls = route.instance.in_flight if route.instance is not None else 1
        self._sent[id(route)] = (time.perf_counter(), request.context_tokens, max(calls, 1))
        return route

    def release(self, route: Route, *, outcome: CallOutcome, new_tokens: int) -> None:
        self.inner.release(route, outcome=outcome, new_tokens=new_tokens)
        sent = self._sent.pop(id(route), None)
        if sent is None or outcome != "ok":
            return
        when, prompt, calls = sent
        tp = route.instance.spec.tp if route.instance is not None else 1
        seconds = time.perf_counter() - when
        self.observe(CallTiming(route.endpoint.name, tp, prompt, 0, new_tokens, seconds, calls))

    def on_tool_return(self, trajectory_id: str, signal: ToolSignal) -> None:
        self.inner.on_tool_return(trajectory_id, signal)

    def on_finish(
        self, trajectory_id: str, prompt_id: str, *, output_tokens: int, failed: bool = False
    ) -> None:
        self.inner.on_finish(trajectory_id, prompt_id, output_tokens=output_tokens, failed=failed)

    def calls_in_flight(self) -> dict[str, int]:
        return self.inner.calls_in_flight()
