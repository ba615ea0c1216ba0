"""The routing policies: C-MLFQ and the baselines a user would otherwise pick.

Each is a :class:`RoutedPolicy` over a :class:`~libra.sched.Router`, implementing the
engine's :class:`~libra.sched.Scheduler` protocol, and registers itself under its
``name``. C-MLFQ (:class:`CMLFQ`) is driven by the causal :class:`PrefixForest` of
tool-return paths. :func:`make_policy` builds any of them by name.
"""

from libra.config import old_names
from libra.sched.policies._base import (
    REGISTRY,
    Choice,
    PolicyOptions,
    RouteDecision,
    RoutedPolicy,
    Track,
    Truth,
)
from libra.sched.policies._baselines import (
    PLAS,
    LeastLoadedCapacity,
    LeastLoadedScheduler,
    LengthPrediction,
    RoundRobin,
    SortedLength,
    StaticPrompt,
)
from libra.sched.policies._cmlfq import (
    CMLFQ,
    CMLFQConfig,
    LibraCMLFQ,
    ReferenceCMLFQ,
    ReferenceCostCMLFQ,
    reference_cost,
    reference_simple,
)
from libra.sched.policies._oracle import Oracle, OracleFinish, OracleSimple
from libra.sched.policies._predict import (
    FeaturePredictor,
    OraclePredictor,
    Predictor,
    PromptHistoryPredictor,
    TreePredictor,
)
from libra.sched.policies._prefix_tree import PrefixForest, PrefixTree, Residual, TreeConfig
from libra.sched.policies._registry import (
    ABLATIONS,
    DEFAULT_POLICIES,
    ORACLES,
    POLICIES,
    make_policy,
)

__all__ = [
    "ABLATIONS",
    "CMLFQ",
    "DEFAULT_POLICIES",
    "ORACLES",
    "PLAS",
    "POLICIES",
    "REGISTRY",
    "CMLFQConfig",
    "Choice",
    "FeaturePredictor",
    "LeastLoadedCapacity",
    "LeastLoadedScheduler",
    "LengthPrediction",
    "LibraCMLFQ",
    "Oracle",
    "OracleFinish",
    "OraclePredictor",
    "OracleSimple",
    "PolicyOptions",
    "Predictor",
    "PrefixForest",
    "PrefixTree",
    "PromptHistoryPredictor",
    "ReferenceCMLFQ",
    "ReferenceCostCMLFQ",
    "Residual",
    "RoundRobin",
    "RouteDecision",
    "RoutedPolicy",
    "SortedLength",
    "StaticPrompt",
    "Track",
    "TreeConfig",
    "TreePredictor",
    "Truth",
    "make_policy",
    "reference_cost",
    "reference_simple",
]

#: The names of the last release, for one more (each warns).
__getattr__ = old_names("libra.sched.policies", {"Decision": ("RouteDecision", RouteDecision)})
