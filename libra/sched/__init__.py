"""Scheduling: which serving endpoint runs a trajectory's next generation call.

The engine talks to a :class:`Scheduler` (``_protocol``). Policies built on the
:class:`Router` (buckets of instances with live load, fallbacks, stickiness) implement
it: C-MLFQ (:class:`CMLFQ`, driven by the causal :class:`PrefixForest` of tool-return
paths) and the baselines a user would otherwise pick. :func:`make_policy` builds any of
them by name.
"""

from libra.sched._baselines import (
    PLAS,
    LengthPrediction,
    Oracle,
    OracleFinish,
    RoundRobin,
    SortedLength,
    StaticPrompt,
)
from libra.sched._buckets import Bucket, Instance, Router, event_loop_clock
from libra.sched._cmlfq import CMLFQ, CMLFQConfig, reference_cost, reference_simple
from libra.sched._factory import DEFAULT_POLICIES, ORACLES, POLICIES, make_policy
from libra.sched._fleet import BucketSpec, FleetSpec, InstanceSpec, StepCost
from libra.sched._least_loaded import LeastLoadedScheduler
from libra.sched._metrics import parse_metrics, poll_metrics, poll_once
from libra.sched._policy import Choice, Decision, RoutedPolicy, Track
from libra.sched._predict import (
    OraclePredictor,
    Predictor,
    PromptHistoryPredictor,
    TreePredictor,
)
from libra.sched._prefix_tree import PrefixForest, PrefixTree, Residual, TreeConfig
from libra.sched._protocol import (
    Endpoint,
    NoEndpointAvailable,
    Route,
    RouteRequest,
    Scheduler,
    SizeClass,
    ToolSignal,
    ToolStatus,
)
from libra.sched._signals import SignalMap, SignalRule

__all__ = [
    "CMLFQ",
    "DEFAULT_POLICIES",
    "ORACLES",
    "PLAS",
    "POLICIES",
    "Bucket",
    "BucketSpec",
    "CMLFQConfig",
    "Choice",
    "Decision",
    "Endpoint",
    "FleetSpec",
    "Instance",
    "InstanceSpec",
    "LeastLoadedScheduler",
    "LengthPrediction",
    "NoEndpointAvailable",
    "Oracle",
    "OracleFinish",
    "OraclePredictor",
    "Predictor",
    "PrefixForest",
    "PrefixTree",
    "PromptHistoryPredictor",
    "Residual",
    "RoundRobin",
    "Route",
    "RouteRequest",
    "RoutedPolicy",
    "Router",
    "Scheduler",
    "SignalMap",
    "SignalRule",
    "SizeClass",
    "SortedLength",
    "StaticPrompt",
    "StepCost",
    "ToolSignal",
    "ToolStatus",
    "Track",
    "TreeConfig",
    "TreePredictor",
    "event_loop_clock",
    "make_policy",
    "parse_metrics",
    "poll_metrics",
    "poll_once",
    "reference_cost",
    "reference_simple",
]
