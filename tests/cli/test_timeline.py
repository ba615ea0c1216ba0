"""The rollout timeline follows the fleet as instances join and leave."""

from __future__ import annotations

from libra.cli._timeline import Timeline
from libra.engine import RolloutStats
from libra.fleet import Endpoint, InstanceSpec
from libra.sched import RouteRequest
from libra.sched.policies import LeastLoadedScheduler


def test_every_series_has_a_sample_per_tick_while_instances_join_and_leave() -> None:
    policy = LeastLoadedScheduler([Endpoint("http://x", name="x")])
    timeline, stats = Timeline(), RolloutStats()
    timeline.sample(0.0, policy, stats)
    policy.router.add_instance(InstanceSpec(name="y", url="http://y"), "all")
    policy.route(RouteRequest("t/0#0", "t/0", 0, 10))
    timeline.sample(1.0, policy, stats)
    policy.router.remove("x", force=True)
    timeline.sample(2.0, policy, stats)
    assert timeline.calls_in_flight == {"x": [0, 1, 0], "y": [0, 0, 0]}
