"""Scheduling: which serving endpoint runs a trajectory's next generation call.

The engine talks to a :class:`Scheduler` (``_protocol``) and nothing else. The
:class:`Router` keeps buckets of instances with their live load, fallbacks and
stickiness, and is the live fleet: instances and buckets are added, drained and
removed through it while trajectories run. A :class:`SignalMap` reduces tool-return
signals to the states C-MLFQ keys its prefix tree by. The policies themselves (C-MLFQ
and the baselines) live in :mod:`libra.sched.policies`, which only the composition
root, the benchmarks and the command line import.
"""

from libra.sched._buckets import Router, event_loop_clock
from libra.sched._instance import Bucket, Instance, InstanceState
from libra.sched._metrics import parse_metrics, poll_metrics, poll_once
from libra.sched._protocol import (
    CallOutcome,
    NoEndpointAvailable,
    Route,
    RouteRequest,
    Scheduler,
)
from libra.sched._signals import SignalMap, SignalRule
from libra.sched._wakeups import Latch, Pulse

__all__ = [
    "Bucket",
    "CallOutcome",
    "Instance",
    "InstanceState",
    "Latch",
    "NoEndpointAvailable",
    "Pulse",
    "Route",
    "RouteRequest",
    "Router",
    "Scheduler",
    "SignalMap",
    "SignalRule",
    "event_loop_clock",
    "parse_metrics",
    "poll_metrics",
    "poll_once",
]
