"""Training: the FSDP2 trainer, weight sync into the serving fleet, logprob agreement."""

from libra.train._fsdp import (
    DistContext,
    FSDPTrainer,
    StepMetrics,
    TrainerConfig,
    init_distributed,
    spawn,
    split_by_tokens,
)
from libra.train._logprobs import (
    LogprobGap,
    LogprobsMode,
    logprob_gap,
    records_logprob_gap,
    sequence_logprobs,
    server_logprob_temperature,
    server_prompt_logprobs,
)
from libra.train._weights import (
    SyncReport,
    WeightSync,
    WeightSyncConfig,
    WeightSyncError,
    export_weights,
    servable_model,
    write_weights_folder,
)

__all__ = [
    "DistContext",
    "FSDPTrainer",
    "LogprobGap",
    "LogprobsMode",
    "StepMetrics",
    "SyncReport",
    "TrainerConfig",
    "WeightSync",
    "WeightSyncConfig",
    "WeightSyncError",
    "export_weights",
    "init_distributed",
    "logprob_gap",
    "records_logprob_gap",
    "sequence_logprobs",
    "servable_model",
    "server_logprob_temperature",
    "server_prompt_logprobs",
    "spawn",
    "split_by_tokens",
    "write_weights_folder",
]
