"""The emulated fleet of one ``libra bench alloc`` step, laid out by the plan in force:
the instances' workers and servers (playing the truth, each call tapped as vLLM's
per-request metrics would report it), the scheduler's view of them, the hybrid pool's
layout and the cluster that moves them."""

from __future__ import annotations

import anyio

from libra.alloc import CallTiming, Layout, Plan
from libra.bench._alloc_settings import Settings
from libra.bench._emulated_fleet import MODEL, emulated_servers, server_config
from libra.emulation import (
    BatchingEngine,
    ClusterTruth,
    EmulatedCluster,
    EmulatedTrainer,
    EmulatorApp,
    EmulatorConfig,
    FleetApp,
)
from libra.emulation.workloads import ScriptBook, WorkloadScript
from libra.fleet import BucketSpec, FleetSpec, InstanceSpec

_CONTEXT_MARGIN = 8192  # template tokens beyond the workload's own context limit


def serving_units(plan: Plan) -> list[tuple[int, ...]]:
    """The workers of each instance of ``plan``: training takes the first ones."""
    units: list[tuple[int, ...]] = []
    first = plan.train_workers
    for tp in plan.rollout_tps:
        units.append(tuple(range(first, first + tp)))
        first += tp
    return units


def layout_of(
    plan: Plan,
    units: list[tuple[int, ...]],
    lent: tuple[tuple[tuple[int, ...], str], ...],
) -> Layout:
    """The first (largest) instance is core rollout; every other one is hybrid."""
    away = {unit for unit, _ in lent}
    return Layout(
        training=tuple(range(plan.train_workers)),
        rollout=tuple(units[:1]),
        hybrid=tuple(unit for unit in units[1:] if unit not in away),
        lent=lent,
    )


def step_cluster(
    settings: Settings,
    book: ScriptBook,
    step: int,
    trainer: EmulatedTrainer,
    fleet: FleetApp,
    units: list[tuple[int, ...]],
    names: list[str],
) -> EmulatedCluster:
    """The step's workers: the plan's instances serving in ``fleet`` (already started),
    the trainer; a restart costs what starting a server really does."""
    model = settings.fleet
    cluster = EmulatedCluster(
        settings.gpus,
        trainer,
        lambda tp: settings.serving.latency(model.gpu, model.model, tp, model.serving.max_num_seqs),
        server=step_server_config(settings, step, len(units)),
        script=WorkloadScript(book),
        truth=ClusterTruth(start_s=settings.serving.start_s),
    )
    cluster.fleet = fleet
    for name, unit in zip(names, units, strict=True):
        if name in fleet.apps:
            cluster.placement[name] = unit
    return cluster


def fleet_spec(settings: Settings, plan: Plan, apps: dict[str, EmulatorApp]) -> FleetSpec:
    """The scheduler's view: the datasheet cost (not the truth), buckets by the plan."""
    roofline = settings.fleet.roofline
    names = list(apps)
    instances = [
        InstanceSpec(
            name=name,
            url=f"http://{name}",
            model=MODEL,
            api="tokens",
            tp=tp,
            max_num_seqs=settings.fleet.serving.max_num_seqs,
            kv_capacity_tokens=roofline.kv_capacity_tokens(tp),
            cost=roofline.step_cost(tp),
        )
        for name, tp in zip(names, plan.rollout_tps, strict=True)
    ]
    sizes = sorted(set(plan.rollout_tps))
    ceilings = list(plan.bucket_ceilings) if len(plan.bucket_ceilings) == len(sizes) else []
    if not ceilings:
        sizes, ceilings = [0], [settings.workload.limits.max_context_tokens]
    buckets = [
        BucketSpec(
            name=f"b{index}",
            max_tokens=max(1, ceiling),
            instances=[n for n, tp in zip(names, plan.rollout_tps, strict=True) if size in (0, tp)],
        )
        for index, (size, ceiling) in enumerate(zip(sizes, ceilings, strict=True))
    ]
    return FleetSpec(
        instances=instances,
        buckets=buckets,
        max_queue_length=settings.fleet.serving.max_queue_length,
    )


def fleet_apps(
    settings: Settings, plan: Plan, book: ScriptBook, step: int, names: list[str]
) -> tuple[dict[str, EmulatorApp], list[CallTiming]]:
    """One emulated server per instance of the plan (named ``names``), playing the
    truth, with a tap that reports each call as vLLM's per-request metrics would."""
    fleet = settings.fleet
    tps = dict(zip(names, plan.rollout_tps, strict=True))
    configs = {
        name: step_server_config(settings, step, index).model_copy(
            update={
                "latency": settings.serving.latency(
                    fleet.gpu, fleet.model, tps[name], fleet.serving.max_num_seqs
                )
            }
        )
        for index, name in enumerate(names)
    }
    apps = emulated_servers(configs, book)
    calls: list[CallTiming] = []
    for name, app in apps.items():
        assert app.engine is not None
        _tap(app.engine, name, tps[name], calls)
    return apps, calls


def step_server_config(settings: Settings, step: int, index: int) -> EmulatorConfig:
    """The settings of the step's ``index``-th server (its latency is the caller's)."""
    seed = settings.seed * 100_003 + step * 101 + index
    return server_config(settings.workload, settings.fleet, seed, _CONTEXT_MARGIN)


def _tap(engine: BatchingEngine, name: str, tp: int, calls: list[CallTiming]) -> None:
    generate = engine.generate

    async def timed(
        prompt_tokens: int, new_tokens: int, *, priority: int = 0, cached_tokens: int = 0
    ) -> int:
        concurrent = engine.num_running + engine.num_waiting + 1
        sent = anyio.current_time()
        produced = await generate(
            prompt_tokens, new_tokens, priority=priority, cached_tokens=cached_tokens
        )
        seconds = anyio.current_time() - sent
        calls.append(
            CallTiming(name, tp, prompt_tokens, cached_tokens, produced, seconds, concurrent)
        )
        return produced

    setattr(engine, "generate", timed)  # noqa: B010 (a per-instance tap on a bound method)
