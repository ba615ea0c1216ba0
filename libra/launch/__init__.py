"""The composition root: where a run's parts are put together.

Fleets (emulated, the embedded vLLM, URLs or a ``[fleet]`` of buckets), sandboxes, the
scheduler with its saved state, and the engine over them are assembled here, once, for
every front end: ``libra rollout``, ``libra train`` (its run: trainer, workers, fleet,
engine and session, then the RL loop over it), the gateway and the allocation loop.
Runtime packages never import this, nor the policies or the emulator it wires in.
"""

from libra.launch._engine import Assembled, EngineSettings, assemble_engine
from libra.launch._fleet import Fleet, FleetError, local_templates, open_fleet
from libra.launch._rollout import EnvShare, RolloutConfig, open_engine
from libra.launch._sandboxes import SandboxKind, beside, open_sandboxes, warm_up
from libra.launch._scheduler import (
    SCHEDULERS,
    SchedulerName,
    build_scheduler,
    save_scheduler_state,
    scheduler_forest,
)
from libra.launch._session import Player, Share, load_mixture, load_player, open_session
from libra.launch._tasks import read_tasks
from libra.launch._train import evaluate, open_run, train
from libra.launch._train_config import TrainRunConfig
from libra.launch._view import ViewOptions, run_events

__all__ = [
    "SCHEDULERS",
    "Assembled",
    "EngineSettings",
    "EnvShare",
    "Fleet",
    "FleetError",
    "Player",
    "RolloutConfig",
    "SandboxKind",
    "SchedulerName",
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
    "open_engine",
    "open_fleet",
    "open_run",
    "open_sandboxes",
    "open_session",
    "read_tasks",
    "run_events",
    "save_scheduler_state",
    "scheduler_forest",
    "train",
    "warm_up",
]
