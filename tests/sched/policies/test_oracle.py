"""The oracles: C-MLFQ's rules fed each trajectory's future."""

from __future__ import annotations

import pytest

from libra.sched import Router
from libra.sched.policies import OracleSimple, Truth, make_policy
from tests._helpers import PASS, Trajectory, fleet


@pytest.mark.parametrize(("name", "shared"), [("oracle", False), ("oracle-finish", True)])
def test_the_oracle_counts_the_tool_seconds_still_to_come(name: str, shared: bool) -> None:
    # Two trajectories with 3,000 tokens left; the first's tools still take 400 s, so it
    # is the straggler, and only the oracle that knows so keeps the other off its instance.
    truth = Truth({"x/1#0": [(1500, 400.0), (1500, 0.0)], "y/1#0": [(3000, 0.0)]})
    policy = make_policy(name, fleet(), truth=truth)
    straggler = Trajectory(policy, "x/1#0").call(100)
    assert straggler.endpoint.name == "c"
    other = Trajectory(policy, "y/1#0").call(100)
    assert (other.endpoint.name == "c") is shared


def test_the_references_oracle_buckets_by_the_true_remaining_length() -> None:
    totals = {"t/1#0": 25000, "t/2#0": 1000}
    policy = OracleSimple(Router(fleet()), Truth.of_totals(totals))
    straggler = Trajectory(policy, "t/1#0")
    assert straggler.call(20000).bucket == "long"
    straggler.tool(PASS)
    assert straggler.call(100).bucket == "medium"  # 5,000 left
    assert Trajectory(policy, "t/2#0").call(10).bucket == "short"
