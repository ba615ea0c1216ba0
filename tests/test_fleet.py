"""The fleet's vocabulary: a consistent fleet spec and the step cost of an instance."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from libra.fleet import BucketSpec, FleetSpec, InstanceSpec, StepCost


def test_a_fleet_must_be_consistent() -> None:
    one = [InstanceSpec(name="x", url="http://x")]
    with pytest.raises(ValidationError, match="unknown instance"):
        FleetSpec(instances=one, buckets=[BucketSpec(name="b", max_tokens=1, instances=["y"])])
    with pytest.raises(ValidationError, match="exactly one bucket"):
        FleetSpec(instances=[*one, InstanceSpec(name="z", url="http://z")],
                  buckets=[BucketSpec(name="b", max_tokens=1, instances=["x"])])  # fmt: skip
    assert [b.name for b in FleetSpec(instances=one).buckets] == ["all"]


def test_step_cost_defaults_scale_with_tensor_parallelism() -> None:
    one, four = StepCost.for_tp(1), StepCost.for_tp(4)
    assert four.step_time(1, 8000) < one.step_time(1, 8000) / 2  # faster per token
    assert four.step_time(1, 8000) * 4 > one.step_time(1, 8000)  # but not per GPU
    assert InstanceSpec(name="x", url="http://x", tp=2).step_cost == StepCost.for_tp(2)
