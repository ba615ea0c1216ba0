"""``libra train``'s run, assembled: the trainer's processes (or the worker cluster with
``[alloc]``), the serving fleet (our own vLLM in dev mode on an untied copy of the model,
servers given by URL, a ``libra serve`` gateway, or the emulator), sandboxes, scheduler
and engine (:func:`open_engine`), and one rollout session; then the RL loop
(``libra.train``) runs on it."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import anyio
from rich.console import Console

from libra.alloc import (
    AllocationLoop,
    CallTiming,
    HybridPool,
    Layout,
    PoolConfig,
    TailLender,
    start_layout,
)
from libra.config import ConfigError, UsageError
from libra.engine import Engine
from libra.envs import Env, Task, TaskId, env_name, load_env
from libra.events import EVENTS_FILE, EventBus
from libra.fleet import FleetSpec
from libra.gateway import GatewayConfig, gateway_keys
from libra.launch._alloc import rule_planner
from libra.launch._gateway import open_gateway
from libra.launch._rollout import open_engine
from libra.launch._scheduler import scheduler_forest
from libra.launch._session import Player, Share, load_mixture, open_session
from libra.launch._tasks import read_tasks
from libra.launch._tracking import tracking
from libra.launch._train_config import TrainRunConfig
from libra.launch._view import PublishedRun, ViewOptions, last_t, run_events
from libra.sched import Scheduler
from libra.serving import (
    EMBEDDED_MODEL_NAME,
    VLLMServer,
    VLLMServerConfig,
    resolve_model,
    vllm_command,
    with_lora_adapter,
)
from libra.tracking import check_installed
from libra.train import (
    SESSION_HEADER,
    CheckpointHook,
    EvalSuite,
    Evaluation,
    GatewayClient,
    GroupSource,
    OnlineConfig,
    OnlineGroups,
    Progress,
    RolloutLog,
    ServedWeights,
    StepGroups,
    StepRecord,
    StepTasks,
    TaskShare,
    TrainRun,
    check_attached,
    find_gateway,
    no_progress,
    prepare_run_dir,
    run_steps,
)
from libra.trainer import (
    Checkpoint,
    LoadCheckpoint,
    TrainerProcess,
    TrainerWorld,
    checkpoint_dir,
    checkpoint_path,
    find_latest,
    servable_model,
    write_zero_adapter,
)
from libra.view import RecordFiles
from libra.workers import Allocation, TimedScheduler, WorkerCluster, open_cluster


async def train(
    config: TrainRunConfig,
    *,
    resume: bool = False,
    checkpoint: CheckpointHook | None = None,
    on_step: Callable[[StepRecord], None] = lambda record: None,
    progress: Progress = no_progress,
    view: ViewOptions | None = None,
) -> list[StepRecord]:
    """Run ``config.steps`` steps (from the newest checkpoint's step with ``resume``);
    returns the metrics lines of the steps it ran (also in the run folder). The run's
    events go to its ``events.jsonl`` (``libra view RUN_DIR``), and with ``view`` to
    the live view as well."""
    shares = load_mixture(config.rollout) if config.online is None else [Share(ONLINE)]
    tasks = None if config.online is not None else _step_tasks(config, shares)
    suites = _eval_suites(config, shares)
    check_installed(config.tracking)  # before anything starts
    run_dir = prepare_run_dir(config.run_dir, config.to_toml(), resume=resume)
    config = _with_saved_forest(config, run_dir) if resume else config
    log = run_dir / EVENTS_FILE
    bus = EventBus(offset=last_t(log) if resume else 0.0)
    if not resume:
        log.unlink(missing_ok=True)  # a run killed before its first line: not this run's
    records = RecordFiles(lambda: sorted(run_dir.glob("rollouts/*.jsonl")))
    async with (
        run_events(bus, log=log, view=view, find_record=records),
        tracking(config, run_dir, resume, bus),
        open_run(config, shares, run_dir, tasks, suites, events=bus) as run,
    ):
        run.observers = [PublishedRun(bus)]
        return await run_steps(
            run, resume=resume, checkpoint=checkpoint, on_step=on_step, progress=progress
        )


async def evaluate(config: TrainRunConfig, step: int | None = None) -> dict[str, Any]:
    """``libra eval``: the run folder's checkpoint after ``step`` steps (None: the
    newest), evaluated alone with the run's config and its ``[eval]`` (every env of the
    run on seeded tasks, unless it names its own): the servers serve its weights, and
    its line goes to ``eval/checkpoints.jsonl``, its records to
    ``eval/checkpoint-K.jsonl``. Nothing of the run changes."""
    run_dir = config.run_dir
    checkpoint = find_latest(run_dir) if step is None else None
    if step is not None and checkpoint_path(run_dir, step).is_dir():
        checkpoint = Checkpoint.read(checkpoint_path(run_dir, step))
    if checkpoint is None:
        which = "checkpoint" if step is None else f"checkpoint after step {step}"
        raise UsageError(f"{run_dir} holds no {which} (see {checkpoint_dir(run_dir)})")
    shares = load_mixture(config.rollout) if config.online is None else [Share(ONLINE)]
    evaluated = config.eval.model_copy(update={"every": 1})
    config = config.model_copy(update={"eval": evaluated, "online": None})
    suites = _eval_suites(config, shares)
    async with open_run(config, shares, run_dir, _step_tasks(config, shares), suites) as run:
        assert run.evaluation is not None
        state = await run.trainer.call(LoadCheckpoint(checkpoint.path))
        run.version = state.weight_version
        await run.publisher.serve_restored(state.weight_version)
        evaluation = replace(
            run.evaluation, lines_file="eval/checkpoints.jsonl", records_prefix="checkpoint-"
        )
        return await evaluation.run(state.step, state.weight_version)


def _step_tasks(config: TrainRunConfig, shares: list[Share]) -> StepTasks:
    """Each step's tasks, drawn from the mixture of ``shares`` (their task files read
    and checked now, before anything starts)."""
    task_shares = [
        TaskShare(
            share.player.name,
            share.weight,
            read_tasks(share.tasks, share.player.name) if share.tasks is not None else None,
        )
        for share in shares
    ]
    try:
        return StepTasks(task_shares, config.prompts_per_step, config.seed)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _eval_suites(config: TrainRunConfig, shares: list[Share]) -> list[EvalSuite]:
    """``[eval]``'s envs and tasks, loaded now (before anything starts), held apart from
    training's: keys of their own, and seeds from a generator of their own."""
    settings = config.eval
    if not settings.every:
        return []
    named: list[tuple[type[Env] | None, str, Path | None]]
    named = [(share.player.env_cls, share.player.name, None) for share in shares]
    if settings.envs is not None:
        classes = [load_env(entry.env) for entry in settings.envs]
        named = [
            (env_cls, env_name(entry.env, env_cls), entry.tasks)
            for entry, env_cls in zip(settings.envs, classes, strict=True)
        ]
    seeds = random.Random(f"eval:{settings.seed}")
    suites = []
    for env_cls, name, path in named:
        if env_cls is None:
            raise ConfigError("eval: agents play this run; name the envs to evaluate (eval.envs)")
        if path is not None:
            tasks = read_tasks(path, name)
        else:
            tasks = [Task.from_seed(name, seeds.randrange(2**31)) for _ in range(settings.prompts)]
        held_apart = [replace(t, id=TaskId(name, f"eval-{t.id.key}")) for t in tasks]
        suites.append(EvalSuite(name, env_cls, held_apart))
    return suites


def _evaluation(
    config: TrainRunConfig, suites: list[EvalSuite], engine: Engine, run_dir: Path
) -> Evaluation | None:
    """``[eval]`` on the rollout's engine, with its own sampling; None when it is off."""
    if not suites:
        return None
    rollout = config.rollout.engine.sampling
    sampling = rollout.model_copy(
        update={
            "temperature": config.eval.temperature,
            "max_tokens_per_turn": config.eval.max_tokens_per_turn or rollout.max_tokens_per_turn,
        }
    )
    return Evaluation(config.eval, suites, engine, run_dir, sampling)


def _with_saved_forest(config: TrainRunConfig, run_dir: Path) -> TrainRunConfig:
    """The config whose scheduler starts from the newest checkpoint's prefix forest, if
    it saved one and the config names no state file of its own."""
    latest = find_latest(run_dir)
    if latest is None or latest.forest_path is None or config.rollout.scheduler_state:
        return config
    rollout = config.rollout.model_copy(update={"scheduler_state": latest.forest_path})
    return config.model_copy(update={"rollout": rollout})


@asynccontextmanager
async def open_run(
    config: TrainRunConfig,
    shares: list[Share],
    run_dir: Path,
    tasks: StepTasks | None,
    evaluated: list[EvalSuite] | None = None,
    events: EventBus | None = None,
) -> AsyncIterator[TrainRun]:
    """The trainer's processes, the fleet, the engine and one session, all started;
    the run's jobs play ``tasks``, drawn from the mixture of ``shares`` (None: online,
    agents elsewhere play), and ``[eval]`` evaluates the weights on ``evaluated``."""
    model_dir = await anyio.to_thread.run_sync(resolve_model, config.model)
    rollout = config.rollout
    gateway = await _gateway_of(config)
    async with AsyncExitStack() as stack:
        weights = ServedWeights()
        trainer: TrainerWorld
        cluster: WorkerCluster | None = None
        server, model = config.server, rollout.model
        own: dict[str, VLLMServer] = {}
        if config.alloc is not None and config.alloc.enabled:
            served = await anyio.to_thread.run_sync(servable_model, model_dir, run_dir)
            cluster = await stack.enter_async_context(
                open_cluster(
                    config.alloc,
                    config.trainer,
                    model_dir,
                    base=served,
                    server=_own_server_config(config),
                    weights=weights,
                    weights_lock=weights.lock,
                )
            )  # its trainer loads the model while the servers start
            trainer = cluster.trainer
            fleet = await _start_workers(cluster, config.alloc.layout(), _pool_config(config))
            rollout = rollout.model_copy(update={"fleet": fleet})
            server, model = None, EMBEDDED_MODEL_NAME
        else:
            trainer = await stack.enter_async_context(
                TrainerProcess(model_dir, config.trainer, world_size=config.world_size)
            )  # it loads the model while the servers start
        _say_how_lora_syncs(config)
        if cluster is None and server == "embedded":
            served = await anyio.to_thread.run_sync(servable_model, model_dir, run_dir)
            console = Console(stderr=True)
            vllm = await anyio.to_thread.run_sync(_own_server, config, served, run_dir)
            with console.status(f"starting vLLM (dev mode) on {served}"):
                vllm = await stack.enter_async_context(vllm)
            console.print(f"vLLM ready at {vllm.url} (log: {vllm.log_file})", soft_wrap=True)
            server, model = vllm.url, EMBEDDED_MODEL_NAME
            own[vllm.url] = vllm  # its instance is named by its URL
        elif gateway is not None:
            server = gateway.url
        elif server is not None and server != "emulated" and config.reloads:
            await check_attached(server.split(","), config.logprobs_mode)
        rollout = rollout.model_copy(update={"server": server, "model": model, "progress": False})
        warm = min(rollout.sandbox_pool, rollout.engine.concurrency)
        # With [alloc], every call's timing goes to the allocation loop (built below, once
        # the pool has the run's router; no call runs before the loop does).
        calls = _CallTimings()
        assembled = await stack.enter_async_context(
            open_engine(
                rollout,
                [share.player.env_cls for share in shares if share.player.env_cls],
                warm,
                servers=own if cluster is None else cluster.servers,
                weights=weights,
                headers=gateway.headers if gateway is not None else None,
                wrap_scheduler=None if cluster is None else partial(TimedScheduler, observe=calls),
                events=events,
            )
        )
        log = stack.enter_context(RolloutLog(run_dir))
        # (an agent plays alone; a mixture's envs each play their own trajectories)
        player = shares[0].player
        session = await stack.enter_async_context(open_session(assembled.engine, rollout, player))
        rollouts: GroupSource
        if tasks is None:
            assert config.online is not None
            rollouts = await _serve_online(stack, config, config.online, assembled.engine, log)
        else:
            players = {share.player.name: share.player.env_cls for share in shares}
            rollouts = StepGroups(config, players, tasks, session, log)
        await trainer.ready()
        scheduler = assembled.scheduler  # the run's own, not the engine's timed wrapper
        endpoints = list(scheduler.router.endpoints().values())
        if gateway is not None:  # its scheduler sees each trajectory's turns as one
            for endpoint in endpoints:
                endpoint.session_header = SESSION_HEADER
        run = TrainRun(
            config,
            run_dir,
            rollouts,
            trainer,
            session,
            endpoints,
            scheduler,
            log,
            weights,
            gateway,
            forest=partial(scheduler_forest, scheduler),
            evaluation=_evaluation(config, evaluated or [], assembled.engine, run_dir),
        )
        if cluster is not None:
            cluster.supervisor = assembled.supervisor  # watches the instances it starts
            allocation = await _allocation(stack, config, cluster, scheduler)
            calls.observe = allocation.loop.observe_call
            run.allocation = allocation
        async with anyio.create_task_group() as group:
            group.start_soon(trainer.watch)
            group.start_soon(run.read_records)
            yield run
            group.cancel_scope.cancel()


#: What an online run plays: nothing of its own (agents elsewhere do), under this name.
ONLINE = Player(None, None, "online")


async def _serve_online(
    stack: AsyncExitStack,
    config: TrainRunConfig,
    online: OnlineConfig,
    engine: Engine,
    log: RolloutLog,
) -> OnlineGroups:
    """The gateway over the run's engine, served where ``online`` says: the sessions its
    clients end are the run's groups (``libra.train.OnlineGroups``)."""
    keys = gateway_keys(
        online.host,
        no_auth=online.no_auth,
        api_key_file=online.api_key_file,
        admin_key_file=online.admin_key_file,
    )
    groups = OnlineGroups(config, online, log)
    stack.callback(groups.close)  # after the sessions' shutdown: what no step took
    gateway = GatewayConfig(
        env=ONLINE.name,
        session_ttl_s=online.session_ttl_s,
        sampling=engine.config.sampling,
        any_model=True,  # one policy answers, whatever model a client names
    )
    opening = open_gateway(
        engine, gateway, keys, host=online.host, port=online.port, on_end=groups.add
    )
    url = (await stack.enter_async_context(opening)).url
    auth = "API key required" if keys.enabled else "no auth (loopback)"
    print(f"libra train --online: agents call {url}/v1 ({auth})", flush=True)
    return groups


class _CallTimings:
    """Where the engine's timed scheduler sends each call's timing: the allocation loop,
    once it is built."""

    def __init__(self) -> None:
        self.observe: Callable[[CallTiming], None] = lambda timing: None

    def __call__(self, timing: CallTiming) -> None:
        self.observe(timing)


async def _gateway_of(config: TrainRunConfig) -> GatewayClient | None:
    """The ``libra serve`` gateway ``config.server`` names (one URL), or None: a gateway
    takes the run's rollouts and weight syncs (see ``libra.train.Gateway``)."""
    server = config.server
    if server in (None, "embedded", "emulated") or "," in server:
        return None
    return await find_gateway(server, sync_timeout_s=config.sync.timeout_s)


def _own_server(config: TrainRunConfig, served: Path, run_dir: Path) -> VLLMServer:
    """vLLM on ``served`` in dev mode (reloads), with the logprobs the trainer expects.
    With LoRA adapters synced alone, the rollouts' model name is the adapter's (a zero
    one to start: the base model), and the base model goes by another."""
    server_config = _own_server_config(config)
    if not config.adapter_sync:
        return VLLMServer(served, served_model_name=EMBEDDED_MODEL_NAME, config=server_config)
    lora = config.trainer.lora
    adapter = write_zero_adapter(served, lora, run_dir / "weights" / "adapter-v0")
    server_config = with_lora_adapter(server_config, EMBEDDED_MODEL_NAME, adapter, lora.rank)
    return VLLMServer(served, served_model_name=f"{EMBEDDED_MODEL_NAME}-base", config=server_config)


def _say_how_lora_syncs(config: TrainRunConfig) -> None:
    lora = config.trainer.lora
    if not lora.enabled or not config.reloads:
        return
    if config.adapter_sync:
        how = "the adapters alone, loaded by vLLM at runtime"
    else:
        how = (
            "the weights with the adapters merged in (these servers are not the run's own "
            "vLLM, which loads adapters)"
        )
    Console(stderr=True).print(f"LoRA rank {lora.rank}: each step syncs {how}", soft_wrap=True)


def own_server_command(config: TrainRunConfig) -> list[str] | None:
    """The command line the run's own vLLM starts with, what ``auto`` settings resolve
    to included (its port and seed are picked at each start; an ``[alloc]`` worker's
    server is also bound to the worker's cores); None: it starts none."""
    if config.server != "embedded" and not (config.alloc is not None and config.alloc.enabled):
        return None
    served = str(config.run_dir / "weights" / "v0")
    return vllm_command(_own_server_config(config), served, EMBEDDED_MODEL_NAME, 0)


def _own_server_config(config: TrainRunConfig) -> VLLMServerConfig:
    extra: tuple[str, ...] = ("--logprobs-mode", config.logprobs_mode)
    if config.sync.transport == "gloo":  # Libra's engine, from its vLLM plugin
        extra += ("--weight-transfer-config", '{"backend": "gloo"}')
    # It serves what the trainer exports: the export's dtype (None: the folder's, auto).
    dtype = config.export_dtype or "auto"
    return config.vllm.model_copy(
        update={"dev_mode": True, "dtype": dtype, "extra_args": (*config.vllm.extra_args, *extra)}
    )


# ---------------------------------------------------------------------- [alloc]


def _pool_config(config: TrainRunConfig) -> PoolConfig:
    assert config.alloc is not None
    return config.alloc.pool.model_copy(update={"model": EMBEDDED_MODEL_NAME})


async def _start_workers(cluster: WorkerCluster, layout: Layout, pool: PoolConfig) -> FleetSpec:
    """Every serving unit's vLLM, started at once: the run's fleet."""
    console = Console(stderr=True)
    with console.status(f"starting {len(layout.units())} vLLM servers (dev mode)"):
        fleet = await start_layout(cluster, layout, pool)
    for name, vllm in cluster.servers.items():
        console.print(f"{name}: vLLM ready at {vllm.url} (log: {vllm.log_file})", soft_wrap=True)
    return fleet


async def _allocation(
    stack: AsyncExitStack, config: TrainRunConfig, cluster: WorkerCluster, scheduler: Scheduler
) -> Allocation:
    """The pool over the run's router (its moves end before the engine closes) and the
    loop that decides after each step."""
    assert config.alloc is not None
    layout, pool_config = config.alloc.layout(), _pool_config(config)
    pool = await stack.enter_async_context(
        HybridPool(cluster, scheduler.router, layout, pool_config)
    )
    planner = rule_planner(cluster.base, config.alloc.gpu, config.rollout.scheduler)
    tail = config.alloc.tail
    lender = TailLender(pool, tail) if tail is not None else None
    return Allocation(cluster, pool, AllocationLoop(planner, pool, config.alloc.loop), lender)
