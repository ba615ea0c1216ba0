"""Training: batches from rollout records, the GRPO loss, the FSDP2 trainer, weight sync
into the serving fleet, and trainer/server logprob agreement."""

from libra.train._batch import (
    Batch,
    MicroBatch,
    Sample,
    build_batch,
    group_advantages,
    plan_micro_batches,
)
from libra.train._config import Aggregation, GRPOConfig, Layout, StaleRule, TrainConfig
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
from libra.train._loss import (
    LossMetrics,
    aggregation_weights,
    grpo_loss,
    sequence_token_weight,
    staleness_weight,
    token_logprobs,
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
    "Aggregation",
    "Batch",
    "DistContext",
    "FSDPTrainer",
    "GRPOConfig",
    "Layout",
    "LogprobGap",
    "LogprobsMode",
    "LossMetrics",
    "MicroBatch",
    "Sample",
    "StaleRule",
    "StepMetrics",
    "SyncReport",
    "TrainConfig",
    "TrainerConfig",
    "WeightSync",
    "WeightSyncConfig",
    "WeightSyncError",
    "aggregation_weights",
    "build_batch",
    "export_weights",
    "group_advantages",
    "grpo_loss",
    "init_distributed",
    "logprob_gap",
    "plan_micro_batches",
    "records_logprob_gap",
    "sequence_logprobs",
    "sequence_token_weight",
    "servable_model",
    "server_logprob_temperature",
    "server_prompt_logprobs",
    "spawn",
    "split_by_tokens",
    "staleness_weight",
    "token_logprobs",
    "write_weights_folder",
]
