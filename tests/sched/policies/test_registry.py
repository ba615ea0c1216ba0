"""Every policy is made by its name."""

from __future__ import annotations

import pytest

from libra.fleet import FleetSpec
from libra.sched.policies import POLICIES, LeastLoadedScheduler, Truth, make_policy
from tests._helpers import PASS, Trajectory, fleet


def test_every_policy_is_made_by_name() -> None:
    spec: FleetSpec = fleet()
    totals = {"t/1#0": 100}
    for name in POLICIES:
        policy = make_policy(name, spec, truth=Truth.of_totals(totals))
        Trajectory(policy, "t/1#0").play([(50, PASS), (50, None)])
    assert isinstance(make_policy("least-loaded", spec), LeastLoadedScheduler)
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("fifo", spec)
    with pytest.raises(ValueError, match="needs the true lengths"):
        make_policy("oracle", spec)
