"""The baseline policies' decisions on constructed cases, through the scheduler protocol only."""

from __future__ import annotations

from libra.sched import Router
from libra.sched.policies import (
    PLAS,
    LengthPrediction,
    Oracle,
    RoundRobin,
    SortedLength,
    StaticPrompt,
)
from tests._helpers import FAIL, PASS, Trajectory, fleet


def test_round_robin_cycles_through_instances_and_skips_excluded_ones() -> None:
    policy = RoundRobin(Router(fleet()))
    names = [Trajectory(policy, f"t/{i}#0").call(10).endpoint.name for i in range(5)]
    assert names == ["a1", "a2", "b", "c", "a1"]
    skipping = Trajectory(policy, "t/9#0").call(10, exclude=frozenset({"a2"}))
    assert skipping.endpoint.name == "b"


def test_static_assignment_keeps_a_prompts_samples_together() -> None:
    policy = StaticPrompt(Router(fleet()))
    homes = {Trajectory(policy, f"task/7#{sample}").call(10).endpoint.name for sample in range(4)}
    assert len(homes) == 1
    home = homes.pop()
    moved = Trajectory(policy, "task/7#9").call(10, exclude=frozenset({home}))
    assert moved.endpoint.name != home
    assert policy.reasons["next_up"] == 1


def test_length_prediction_routes_by_the_prompts_history_for_the_whole_trajectory() -> None:
    policy = LengthPrediction(Router(fleet()))
    first = Trajectory(policy, "hard/1#0")
    assert first.call(100).bucket == "short"
    assert policy.reasons["no_history"] == 1
    first.tool(FAIL)
    first.call(20000)
    first.finish()
    second = Trajectory(policy, "hard/1#1")
    routes = [second.call(100), second.call(100)]
    assert [route.bucket for route in routes] == ["long", "long"]
    assert LengthPrediction(Router(fleet())).predictor.total("x/1") == (0.0, 0)


def test_sorted_runs_shorter_predicted_trajectories_first() -> None:
    policy = SortedLength(Router(fleet()))
    Trajectory(policy, "long/1#0").play([(9000, None)])
    Trajectory(policy, "short/1#0").play([(300, None)])
    long_route = Trajectory(policy, "long/1#1").call(10)
    short_route = Trajectory(policy, "short/1#1").call(10)
    assert short_route.priority is not None and long_route.priority is not None
    assert short_route.priority < long_route.priority  # vLLM: lower runs first


def test_plas_lowers_priority_with_attained_service_and_keeps_long_programs_in_place() -> None:
    policy = PLAS(Router(fleet()), quantum_tokens=512, locality_tokens=2048)
    program = Trajectory(policy, "p/1#0")
    first = program.call(3000)
    assert first.priority == 0
    busy = policy.router.by_name[first.endpoint.name]
    busy.in_flight += 3  # elsewhere is now less loaded, but its KV lives here
    second = program.call(100)
    assert second.endpoint is first.endpoint and policy.reasons["locality"] == 1
    assert second.priority == 2  # log2(1 + 3000/512) = 2.8
    newcomer = Trajectory(policy, "p/2#0").call(100)
    assert newcomer.priority == 0 and newcomer.endpoint is not first.endpoint


def test_the_oracle_buckets_by_the_true_remaining_length() -> None:
    totals = {"t/1#0": 25000, "t/2#0": 1000}
    policy = Oracle(Router(fleet()), totals.__getitem__)
    straggler = Trajectory(policy, "t/1#0")
    assert straggler.call(20000).bucket == "long"
    straggler.tool(PASS)
    assert straggler.call(100).bucket == "medium"  # 5,000 left
    assert Trajectory(policy, "t/2#0").call(10).bucket == "short"
