"""Allocation: how many workers serve and how many train, and moving them as the work drifts."""

from libra.alloc._cost import (
    A100,
    A800,
    H100,
    H200,
    PRESETS,
    Corrections,
    RolloutCost,
    TrainCost,
    TrainSpec,
)
from libra.alloc._planner import (
    PlanLog,
    PlannerConfig,
    ReplanTrigger,
    RooflinePlanner,
    bucket_ceilings,
    mean_output,
    tp_partitions,
)
from libra.alloc._protocol import (
    CallTiming,
    Plan,
    Planner,
    Prediction,
    Role,
    Stage,
    StepTiming,
    Workload,
)

__all__ = [
    "A100",
    "A800",
    "H100",
    "H200",
    "PRESETS",
    "CallTiming",
    "Corrections",
    "Plan",
    "PlanLog",
    "Planner",
    "PlannerConfig",
    "Prediction",
    "ReplanTrigger",
    "Role",
    "RolloutCost",
    "RooflinePlanner",
    "Stage",
    "StepTiming",
    "TrainCost",
    "TrainSpec",
    "Workload",
    "bucket_ceilings",
    "mean_output",
    "tp_partitions",
]
