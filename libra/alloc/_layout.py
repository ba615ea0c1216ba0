"""A hybrid pool's starting point: its config (how it names, registers and bounds what it
moves), its :class:`Layout` (which workers serve, train or are hybrid at the start), and
:func:`start_layout`, which starts it."""

from __future__ import annotations

from dataclasses import dataclass

import anyio
from pydantic import Field, PositiveFloat, PositiveInt

from libra.alloc._protocol import Cluster, Role
from libra.config import Section
from libra.fleet import Api, FleetSpec, InstanceSpec


class PoolConfig(Section):
    """How the pool names, registers and bounds what it moves."""

    model: str = Field("default", description="served model name of the instances")
    api: Api = Field("auto", description="how the engine calls the instances (a fleet's api)")
    bucket: str = Field("", description="bucket of a new instance (empty: the longest)")
    max_num_seqs: PositiveInt = Field(
        256, description="sequences the scheduler takes an instance to run at once"
    )
    kv_capacity_tokens: PositiveInt = Field(
        200_000, description="tokens the scheduler takes an instance's KV cache to hold"
    )
    start_timeout_s: PositiveFloat = Field(600.0, description="an instance start, each try")
    start_attempts: PositiveInt = Field(3, description="tries to start an instance again")
    drain_timeout_s: PositiveFloat = Field(
        300.0, description="then the calls still running are cut and retried elsewhere"
    )
    stop_timeout_s: PositiveFloat = Field(
        60.0, description="seconds a drained instance has to stop; then it is started again"
    )
    fetch_timeout_s: PositiveFloat = Field(600.0, description="fetching the training state")
    zero_sync_timeout_s: PositiveFloat = Field(
        120.0, description="seconds a joining unit has for its zero-gradient exchange"
    )
    activate_timeout_s: PositiveFloat = Field(
        120.0, description="seconds a joining unit has to take its share of the batch"
    )
    leave_timeout_s: PositiveFloat = Field(
        60.0, description="seconds a unit's workers have to leave training"
    )


@dataclass(frozen=True, slots=True)
class Layout:
    """Which workers do what at the start. ``rollout`` and ``hybrid`` are units (the
    workers of one instance each); hybrid units start serving, except the ``lent`` ones:
    hybrid units on the training side (borrowed before), each with the bucket its
    instance serves in once released (empty: the pool's choice)."""

    training: tuple[int, ...]
    rollout: tuple[tuple[int, ...], ...] = ()
    hybrid: tuple[tuple[int, ...], ...] = ()
    lent: tuple[tuple[tuple[int, ...], str], ...] = ()

    def units(self) -> list[tuple[tuple[int, ...], Role]]:
        serving: list[tuple[tuple[int, ...], Role]] = [(u, "core-rollout") for u in self.rollout]
        return serving + [(u, "hybrid") for u in self.hybrid]

    def check(self, workers: int) -> None:
        units = [unit for unit, _ in self.units()] + [unit for unit, _ in self.lent]
        used = list(self.training) + [w for unit in units for w in unit]
        if sorted(used) != sorted(set(used)) or any(not 0 <= w < workers for w in used):
            raise ValueError(f"a layout uses each of the {workers} workers at most once")
        if any(not unit for unit in units):
            raise ValueError("a unit holds at least one worker")


def instance_name(workers: tuple[int, ...]) -> str:
    """``w3`` or ``w4-5``: a host name, so that it can be its own URL's host."""
    return "w" + "-".join(str(worker) for worker in workers)


async def start_layout(
    cluster: Cluster, layout: Layout, config: PoolConfig | None = None
) -> FleetSpec:
    """Start every serving unit's instance and bring the core-training workers into
    training, all at once; the fleet spec of the instances (one bucket) to build the
    router over."""
    layout.check(cluster.workers)
    config = config or PoolConfig()
    urls: dict[tuple[int, ...], str] = {}

    async def start(workers: tuple[int, ...]) -> None:
        with anyio.fail_after(config.start_timeout_s):
            urls[workers] = await cluster.start_instance(instance_name(workers), workers)

    async def train(worker: int) -> None:
        for operation in (cluster.fetch_state, cluster.zero_sync, cluster.activate):
            await operation(worker)

    async with anyio.create_task_group() as group:
        for workers, _ in layout.units():
            group.start_soon(start, workers)
        for worker in layout.training:
            group.start_soon(train, worker)
    specs = [
        InstanceSpec(
            name=instance_name(workers),
            url=urls[workers],
            model=config.model,
            api=config.api,
            tp=len(workers),
            max_num_seqs=config.max_num_seqs,
            kv_capacity_tokens=config.kv_capacity_tokens,
        )
        for workers, _ in layout.units()
    ]
    return FleetSpec(instances=specs)
