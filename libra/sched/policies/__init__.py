"""The routing policies: C-MLFQ and the baselines a user would otherwise pick.

Each is a :class:`RoutedPolicy` over a :class:`~libra.sched.Router` (least-loaded aside),
implementing the engine's :class:`~libra.sched.Scheduler` protocol. C-MLFQ
(:class:`CMLFQ`) is driven by the causal :class:`PrefixForest` of tool-return paths.
:func:`make_policy` builds any of them by name.
"""

from libra.sched.policies._base import Choice, Decision, RoutedPolicy, Track
from libra.sched.policies._baselines import (
    PLAS,
    LengthPrediction,
    Oracle,
    OracleFinish,
    RoundRobin,
    SortedLength,
    StaticPrompt,
)
from libra.sched.policies._cmlfq import CMLFQ, CMLFQConfig, reference_cost, reference_simple
from libra.sched.policies._least_loaded import LeastLoadedScheduler
from libra.sched.policies._predict import (
    OraclePredictor,
    Predictor,
    PromptHistoryPredictor,
    TreePredictor,
)
from libra.sched.policies._prefix_tree import PrefixForest, PrefixTree, Residual, TreeConfig
from libra.sched.policies._registry import DEFAULT_POLICIES, ORACLES, POLICIES, make_policy

__all__ = [
    "CMLFQ",
    "DEFAULT_POLICIES",
    "ORACLES",
    "PLAS",
    "POLICIES",
    "CMLFQConfig",
    "Choice",
    "Decision",
    "LeastLoadedScheduler",
    "LengthPrediction",
    "Oracle",
    "OracleFinish",
    "OraclePredictor",
    "Predictor",
    "PrefixForest",
    "PrefixTree",
    "PromptHistoryPredictor",
    "Residual",
    "RoundRobin",
    "RoutedPolicy",
    "SortedLength",
    "StaticPrompt",
    "Track",
    "TreeConfig",
    "TreePredictor",
    "make_policy",
    "reference_cost",
    "reference_simple",
]
