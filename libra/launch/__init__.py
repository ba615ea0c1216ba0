"""The composition root: where a run's parts are put together.

Fleets (emulated, the embedded vLLM, URLs or a ``[fleet]`` of buckets), sandboxes, the
scheduler with its saved state, and the engine over them are assembled here, once, for
every front end: the command line, the trainer, the gateway and the allocation loop.
Runtime packages never import this, nor the policies or the emulator it wires in.
"""

from libra.launch._engine import Assembled, EngineSettings, assemble_engine
from libra.launch._fleet import Fleet, FleetError, local_templates, open_fleet
from libra.launch._rollout import RolloutConfig, open_engine
from libra.launch._sandboxes import SandboxKind, beside, open_sandboxes, warm_up
from libra.launch._scheduler import (
    SCHEDULERS,
    SchedulerName,
    build_scheduler,
    save_scheduler_state,
    scheduler_forest,
)
from libra.launch._tasks import read_tasks

__all__ = [
    "SCHEDULERS",
    "Assembled",
    "EngineSettings",
    "Fleet",
    "FleetError",
    "RolloutConfig",
    "SandboxKind",
    "SchedulerName",
    "assemble_engine",
    "beside",
    "build_scheduler",
    "local_templates",
    "open_engine",
    "open_fleet",
    "open_sandboxes",
    "read_tasks",
    "save_scheduler_state",
    "scheduler_forest",
    "warm_up",
]
