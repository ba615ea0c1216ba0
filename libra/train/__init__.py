"""The RL loop of ``libra train``: one rollout session, a step's groups into a GRPO batch,
training, weights published to the servers, checkpoints and the metrics line; the gateway
client and the attach checks of a run that serves elsewhere. The run it loops over is
assembled by ``libra.launch`` (``open_run``, ``train``); the workers it trains and serves
on are seen through ``libra.alloc``'s protocols only."""

from libra.config import old_names
from libra.train._attach import AttachError, check_attached, problems_of
from libra.train._eval import EVAL_FILE, EvalConfig, EvalEnv, EvalSuite, Evaluation, pass_at_k
from libra.train._gateway import SESSION_HEADER, GatewayClient, GatewaySyncError, find_gateway
from libra.train._groups import GroupSource, StepGroups
from libra.train._loop import (
    CheckpointHook,
    NothingToResume,
    Progress,
    RunObserver,
    TrainRun,
    no_progress,
    prepare_run_dir,
    run_steps,
)
from libra.train._metrics import METRICS_FILE, StepRecord, iter_metrics, step_record
from libra.train._online import OnlineConfig, OnlineGroups
from libra.train._publish import Publisher, ServedWeights
from libra.train._rollout_log import RolloutLog, keep_reusable, read_step, step_file
from libra.train._settings import Mode, RunSettings
from libra.train._tasks import StepTasks, TaskShare

__all__ = [
    "EVAL_FILE",
    "METRICS_FILE",
    "SESSION_HEADER",
    "AttachError",
    "CheckpointHook",
    "EvalConfig",
    "EvalEnv",
    "EvalSuite",
    "Evaluation",
    "GatewayClient",
    "GatewaySyncError",
    "GroupSource",
    "Mode",
    "NothingToResume",
    "OnlineConfig",
    "OnlineGroups",
    "Progress",
    "Publisher",
    "RolloutLog",
    "RunObserver",
    "RunSettings",
    "ServedWeights",
    "StepGroups",
    "StepRecord",
    "StepTasks",
    "TaskShare",
    "TrainRun",
    "check_attached",
    "find_gateway",
    "iter_metrics",
    "keep_reusable",
    "no_progress",
    "pass_at_k",
    "prepare_run_dir",
    "problems_of",
    "read_step",
    "run_steps",
    "step_file",
    "step_record",
]

#: The names of the last release, for one more (each warns).
__getattr__ = old_names("libra.train", {"Gateway": ("GatewayClient", GatewayClient)})
