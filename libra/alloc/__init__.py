"""Allocation: how many workers serve and how many train, and moving them as the work drifts."""

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
    "CallTiming",
    "Plan",
    "Planner",
    "Prediction",
    "Role",
    "Stage",
    "StepTiming",
    "Workload",
]
