"""Allocation: how many workers serve and how many train, and moving them as the work drifts."""

from libra.alloc._cost import (
    A100,
    A800,
    H100,
    H200,
    PRESETS,
    LongestDecodes,
    RolloutCost,
    TrainCost,
    TrainSpec,
)
from libra.alloc._layout import Layout, PoolConfig, instance_name, start_layout
from libra.alloc._loop import AllocationDecision, AllocationLoop, ApplyingPlanner, LoopConfig
from libra.alloc._moves import JOIN_STATES, Move, Transition, WorkerState
from libra.alloc._planner import (
    PlanLog,
    PlannerConfig,
    ReplanTrigger,
    RooflinePlanner,
    bucket_ceilings,
    mean_output,
    tp_partitions,
)
from libra.alloc._pool import HybridPool
from libra.alloc._protocol import (
    CallTiming,
    Cluster,
    Demand,
    JoinState,
    Plan,
    Planner,
    Prediction,
    Role,
    Stage,
    StepAllocation,
    StepTiming,
)
from libra.alloc._tail import (
    TailLender,
    TailRule,
    borrow_pays,
    lend_tail,
    tail_borrow,
    timed_restart_s,
)
from libra.config import old_names
from libra.fleet import Corrections  # moved down: the scheduler fits with it too

__all__ = [
    "A100",
    "A800",
    "H100",
    "H200",
    "JOIN_STATES",
    "PRESETS",
    "AllocationDecision",
    "AllocationLoop",
    "ApplyingPlanner",
    "CallTiming",
    "Cluster",
    "Corrections",
    "Demand",
    "HybridPool",
    "JoinState",
    "Layout",
    "LongestDecodes",
    "LoopConfig",
    "Move",
    "Plan",
    "PlanLog",
    "Planner",
    "PlannerConfig",
    "PoolConfig",
    "Prediction",
    "ReplanTrigger",
    "Role",
    "RolloutCost",
    "RooflinePlanner",
    "Stage",
    "StepAllocation",
    "StepTiming",
    "TailLender",
    "TailRule",
    "TrainCost",
    "TrainSpec",
    "Transition",
    "WorkerState",
    "borrow_pays",
    "bucket_ceilings",
    "instance_name",
    "lend_tail",
    "mean_output",
    "start_layout",
    "tail_borrow",
    "timed_restart_s",
    "tp_partitions",
]

#: The names of the last release, for one more (each warns).
__getattr__ = old_names(
    "libra.alloc",
    {"Decision": ("AllocationDecision", AllocationDecision), "Workload": ("Demand", Demand)},
)
