"""The RL loop of ``libra train``: one rollout session, a step's groups into a GRPO batch,
training, weights published to the servers, checkpoints and the metrics line; the gateway
client and the attach checks of a run that serves elsewhere."""

from libra.train._attach import AttachError, check_attached, problems_of
from libra.train._gateway import GatewaySyncError
from libra.train._loop import (
    METRICS_FILE,
    CheckpointHook,
    NothingToResume,
    StepRecord,
    TrainRun,
    iter_metrics,
    open_run,
    train,
)
from libra.train._rollout_log import RolloutLog, keep_reusable, read_step, step_file
from libra.train._run import Mode, TrainRunConfig

__all__ = [
    "METRICS_FILE",
    "AttachError",
    "CheckpointHook",
    "GatewaySyncError",
    "Mode",
    "NothingToResume",
    "RolloutLog",
    "StepRecord",
    "TrainRun",
    "TrainRunConfig",
    "check_attached",
    "iter_metrics",
    "keep_reusable",
    "open_run",
    "problems_of",
    "read_step",
    "step_file",
    "train",
]
