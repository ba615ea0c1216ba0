"""Experiment tracking: a run's figures logged through the trackers' own libraries
(TensorBoard, W&B, MLflow), each an optional extra imported only when ``[tracking]``
names it."""

from libra.tracking._config import EXTRAS, Backend, TrackingConfig
from libra.tracking._protocol import RunStart, Sample, StepLog, Tracker
from libra.tracking._trackers import Trackers, check_installed, scalars

__all__ = [
    "EXTRAS",
    "Backend",
    "RunStart",
    "Sample",
    "StepLog",
    "Tracker",
    "Trackers",
    "TrackingConfig",
    "check_installed",
    "scalars",
]
