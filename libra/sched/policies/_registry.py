"""Policies by name, as the benchmark and the command line pick them."""

from __future__ import annotations

from collections.abc import Callable

from libra.fleet import FleetSpec
from libra.sched._buckets import Clock, Router, event_loop_clock
from libra.sched._protocol import Scheduler
from libra.sched.policies._base import RoutedPolicy
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

#: Every policy, in the order the benchmark reports them; the oracles need the truth.
POLICIES = (
    "round-robin",
    "least-loaded",
    "static-prompt",
    "length-pred",
    "sorted",
    "plas",
    "cmlfq-ref",
    "cmlfq-cost",
    "cmlfq",
    "oracle",
    "oracle-finish",
)
DEFAULT_POLICIES = POLICIES[:-1]
ORACLES = ("oracle", "oracle-finish")

Truth = Callable[[str], int]


def make_policy(
    name: str,
    fleet: FleetSpec,
    *,
    truth: Truth | None = None,
    config: CMLFQConfig | None = None,
    clock: Clock = event_loop_clock,
) -> Scheduler:
    """A fresh policy ``name`` over ``fleet``. ``truth(trajectory_id)`` (the total output of
    a trajectory) is needed by the oracles; ``config`` tunes ``cmlfq``."""
    if name == "least-loaded":
        return LeastLoadedScheduler([spec.endpoint() for spec in fleet.instances])
    router = Router(fleet, clock=clock)
    if name in ORACLES:
        if truth is None:
            raise ValueError(f"{name} needs the true lengths (truth=...)")
        return Oracle(router, truth) if name == "oracle" else OracleFinish(router, truth)
    makers: dict[str, Callable[[], RoutedPolicy]] = {
        "round-robin": lambda: RoundRobin(router),
        "static-prompt": lambda: StaticPrompt(router),
        "length-pred": lambda: LengthPrediction(router),
        "sorted": lambda: SortedLength(router),
        "plas": lambda: PLAS(router),
        "cmlfq-ref": lambda: CMLFQ(router, reference_simple()),
        "cmlfq-cost": lambda: CMLFQ(router, reference_cost()),
        "cmlfq": lambda: CMLFQ(router, config),
    }
    if name not in makers:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}")
    return makers[name]()
