"""The elastic workers: how workers move between serving and training. A cluster of
workers (local processes or Ray actors) serving vLLM instances and training as an elastic
FSDP2 trainer with hybrid replicas; it is what ``libra.alloc``'s pool drives (a
``libra.alloc.Cluster``)."""

from libra.workers._cluster import (
    Allocation,
    AllocConfig,
    TimedScheduler,
    WorkerCluster,
    open_cluster,
)
from libra.workers._elastic import ElasticTrainer, LoadState, Resize, SaveState, ZeroSync

__all__ = [
    "AllocConfig",
    "Allocation",
    "ElasticTrainer",
    "LoadState",
    "Resize",
    "SaveState",
    "TimedScheduler",
    "WorkerCluster",
    "ZeroSync",
    "open_cluster",
]
