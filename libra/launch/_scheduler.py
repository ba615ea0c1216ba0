"""The scheduler of a run: a policy by name over the fleet, and its state across runs."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import msgspec
from pydantic import AfterValidator, ValidationInfo

from libra.config import ConfigError
from libra.fleet import FleetSpec
from libra.sched import Scheduler
from libra.sched.policies import (
    CMLFQ,
    ORACLES,
    POLICIES,
    CMLFQConfig,
    PrefixForest,
    TreePredictor,
    make_policy,
)

# Every policy but the oracles, which need the true lengths: only the benchmark has them.
SCHEDULERS = [p for p in POLICIES if p not in ORACLES]


def _known(name: str, info: ValidationInfo) -> str:
    if name not in SCHEDULERS:
        field = info.field_name or "scheduler"
        raise ValueError(f"unknown {field} {name!r}; choose from {', '.join(SCHEDULERS)}")
    return name


#: A config field naming a scheduling policy, checked when the config loads.
SchedulerName = Annotated[str, AfterValidator(_known)]


def build_scheduler(
    name: str, fleet: FleetSpec, cmlfq: CMLFQConfig, state: Path | None = None
) -> Scheduler:
    """Policy ``name`` over ``fleet``; C-MLFQ starts from the prefix forest in ``state``
    when that file exists (what earlier runs learnt)."""
    scheduler = make_policy(name, fleet, config=cmlfq)
    if isinstance(scheduler, CMLFQ) and state is not None and state.exists():
        try:
            scheduler.predictor = TreePredictor(PrefixForest.load(state))
        except (ValueError, msgspec.DecodeError) as exc:
            message = f"scheduler_state {state} is not a saved prefix forest: {exc}"
            raise ConfigError(message) from None
    return scheduler


def scheduler_forest(scheduler: Scheduler) -> PrefixForest | None:
    """C-MLFQ's prefix forest (what it learnt), or None for a policy that has none."""
    if isinstance(scheduler, CMLFQ) and scheduler.forest:
        return scheduler.forest
    return None


def save_scheduler_state(scheduler: Scheduler, state: Path | None) -> None:
    """Write what C-MLFQ learnt (its prefix forest) to ``state``, for the next run."""
    if isinstance(scheduler, CMLFQ) and scheduler.forest and state is not None:
        scheduler.forest.save(state)
