"""Scheduling: which serving endpoint runs a trajectory's next generation call."""

from libra.sched._least_loaded import LeastLoadedScheduler
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

__all__ = [
    "Endpoint",
    "LeastLoadedScheduler",
    "NoEndpointAvailable",
    "Route",
    "RouteRequest",
    "Scheduler",
    "SizeClass",
    "ToolSignal",
    "ToolStatus",
]
