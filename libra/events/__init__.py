"""The run's event stream: what the engine, the scheduler's fleet and the training loop
did, published once to a bus that the events log and the live view (``libra view``)
read."""

from libra.events._bus import EventBus, Subscription
from libra.events._events import (
    AnyEvent,
    BucketMoved,
    CallEnded,
    CheckpointWritten,
    EvalEnded,
    Event,
    FleetSampled,
    InstanceSample,
    StepEnded,
    ToolEnded,
    TrajectoryEnded,
    TrajectoryStarted,
)
from libra.events._log import EVENTS_FILE, encode, read_events, write_log

__all__ = [
    "EVENTS_FILE",
    "AnyEvent",
    "BucketMoved",
    "CallEnded",
    "CheckpointWritten",
    "EvalEnded",
    "Event",
    "EventBus",
    "FleetSampled",
    "InstanceSample",
    "StepEnded",
    "Subscription",
    "ToolEnded",
    "TrajectoryEnded",
    "TrajectoryStarted",
    "encode",
    "read_events",
    "write_log",
]
