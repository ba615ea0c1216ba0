"""Policies by name, as the benchmark and the command line pick them.

Every :class:`RoutedPolicy` subclass with a ``name`` registers itself; this module
only reads the registry, after importing every module that defines policies.
"""

from __future__ import annotations

from libra.fleet import FleetSpec
from libra.sched._buckets import Clock, Router, event_loop_clock
from libra.sched.policies import _baselines, _cmlfq, _oracle
from libra.sched.policies._base import REGISTRY, PolicyOptions, RoutedPolicy, Truth
from libra.sched.policies._cmlfq import CMLFQConfig

# Imported for their policies, in the order reports list them.
assert _baselines and _cmlfq and _oracle

#: Every policy, in the order the benchmark reports them; the oracles need the truth.
POLICIES = tuple(REGISTRY)
DEFAULT_POLICIES = tuple(name for name in POLICIES if REGISTRY[name].benchmarked_by_default)
ORACLES = tuple(name for name in POLICIES if REGISTRY[name].needs_truth)
#: C-MLFQ with one mechanism taken out, and what each takes out (``--ablate``).
ABLATIONS = {name: REGISTRY[name].ablates for name in POLICIES if REGISTRY[name].ablates}


def make_policy(
    name: str,
    fleet: FleetSpec,
    *,
    truth: Truth | None = None,
    config: CMLFQConfig | None = None,
    clock: Clock = event_loop_clock,
) -> RoutedPolicy:
    """A fresh policy ``name`` over ``fleet``. The oracles need the ``truth`` (each
    trajectory's future); ``config`` tunes ``cmlfq``."""
    policy = REGISTRY.get(name)
    if policy is None:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}")
    return policy.create(Router(fleet, clock=clock), PolicyOptions(truth, config))
