"""The composition root: where a run's parts are put together.

Fleets (emulated, the embedded vLLM, URLs or a ``[fleet]`` of buckets), sandboxes, the
scheduler with its saved state, the engine over them and the gateway over an engine are
assembled here, once, and each command's run is here: :func:`rollout` (``libra
rollout``), :func:`serve` (``libra serve``) and :func:`train` (``libra train``: trainer,
workers, fleet, engine and session, then the RL loop over it). The CLI parses, shows
progress and prints; it reaches the runtime packages through this one. Runtime packages
never import this, nor the policies or the emulator it wires in.
"""

from libra.engine import RolloutStats
from libra.fleet import FleetSpec
from libra.gateway import GatewayMetrics, Sessions
from libra.launch._alloc import rule_planner
from libra.launch._engine import Assembled, EngineSettings, assemble_engine
from libra.launch._fleet import Fleet, FleetError, local_templates, open_fleet
from libra.launch._gateway import OpenGateway, open_gateway
from libra.launch._rollout import EnvShare, RolloutConfig, open_engine
from libra.launch._run_rollout import Failures, Rollout, rollout
from libra.launch._sandboxes import SandboxKind, beside, open_sandboxes, warm_up
from libra.launch._scheduler import (
    SCHEDULERS,
    SchedulerName,
    build_scheduler,
    save_scheduler_state,
    scheduler_forest,
)
from libra.launch._serve import ServeConfig, serve
from libra.launch._session import (
    Player,
    Share,
    load_mixture,
    load_player,
    open_agent,
    open_session,
)
from libra.launch._tasks import read_tasks
from libra.launch._train import evaluate, open_run, own_server_command, train
from libra.launch._train_config import TrainRunConfig
from libra.launch._view import ViewOptions, run_events

__all__ = [
    "SCHEDULERS",
    "Assembled",
    "EngineSettings",
    "EnvShare",
    "Failures",
    "Fleet",
    "FleetError",
    "FleetSpec",
    "GatewayMetrics",
    "OpenGateway",
    "Player",
    "Rollout",
    "RolloutConfig",
    "RolloutStats",
    "SandboxKind",
    "SchedulerName",
    "ServeConfig",
    "Sessions",
    "Share",
    "TrainRunConfig",
    "ViewOptions",
    "assemble_engine",
    "beside",
    "build_scheduler",
    "evaluate",
    "load_mixture",
    "load_player",
    "local_templates",
    "open_agent",
    "open_engine",
    "open_fleet",
    "open_gateway",
    "open_run",
    "open_sandboxes",
    "open_session",
    "own_server_command",
    "read_tasks",
    "rollout",
    "rule_planner",
    "run_events",
    "save_scheduler_state",
    "scheduler_forest",
    "serve",
    "train",
    "warm_up",
]
