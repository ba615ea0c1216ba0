"""Training: batches from rollout records, the GRPO loss, FSDP2 and weight sync."""

from libra.train._batch import (
    Batch,
    MicroBatch,
    Sample,
    build_batch,
    group_advantages,
    plan_micro_batches,
)
from libra.train._config import Aggregation, GRPOConfig, Layout, StaleRule, TrainConfig
from libra.train._loss import (
    LossMetrics,
    aggregation_weights,
    grpo_loss,
    sequence_token_weight,
    staleness_weight,
    token_logprobs,
)

__all__ = [
    "Aggregation",
    "Batch",
    "GRPOConfig",
    "Layout",
    "LossMetrics",
    "MicroBatch",
    "Sample",
    "StaleRule",
    "TrainConfig",
    "aggregation_weights",
    "build_batch",
    "group_advantages",
    "grpo_loss",
    "plan_micro_batches",
    "sequence_token_weight",
    "staleness_weight",
    "token_logprobs",
]
