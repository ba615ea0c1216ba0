"""What a ``libra bench alloc`` run is given: the workload, the fleet file, the workers and
steps, the seed, the emulated truth of serving and training, full Libra's tail rule, and
the layouts held for a whole run beside the configurations."""

from __future__ import annotations

from dataclasses import dataclass, field

from libra.alloc import Plan, TailRule
from libra.bench._sched_fleet import FleetFile
from libra.emulation import ServingTruth, TrainTruth
from libra.emulation.workloads import Workload


@dataclass(frozen=True)
class Settings:
    workload: Workload
    fleet: FleetFile
    gpus: int
    steps: int
    seed: int = 0
    serving: ServingTruth = field(default_factory=ServingTruth)
    training: TrainTruth = field(default_factory=TrainTruth)
    #: Full Libra's in-step rule: when the rollout's tail lends hybrid units to training.
    tail: TailRule = field(default_factory=TailRule)
    #: Layouts also run, each held for the whole run (``--layouts``).
    layouts: tuple[Plan, ...] = ()
    #: How the held layouts route: C-MLFQ, as full Libra does, or ``oracle`` (its rule
    #: told each trajectory's future: what better routing could still buy).
    layout_policy: str = "cmlfq"
