"""The baseline policies' decisions on constructed cases, through the scheduler protocol only."""

from __future__ import annotations

from libra.sched import Router, RouteRequest
from libra.sched.policies import (
    PLAS,
    LeastLoadedCapacity,
    LeastLoadedScheduler,
    LengthPrediction,
    RoundRobin,
    SortedLength,
    StaticPrompt,
)
from tests._helpers import Trajectory, fleet


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


def test_length_prediction_ranks_new_prompts_by_their_features_for_the_whole_trajectory() -> None:
    policy = LengthPrediction(Router(fleet()))
    first = Trajectory(policy, "old/0#0")
    assert first.call(100).bucket == "short"
    assert policy.reasons["no_history"] == 1
    first.finish()
    for index in range(8):  # long prompts make long trajectories here; short ones, short
        long_prompt = Trajectory(policy, f"old/{index}#1")
        long_prompt.context = 3000
        long_prompt.play([(20000, None)])
        Trajectory(policy, f"old/{index}#2").play([(300, None)])
    long_one, short_one = Trajectory(policy, "new/1#0"), Trajectory(policy, "new/2#0")
    long_one.context = 3000  # prompts never seen: only their features are known
    assert [long_one.call(100).bucket, long_one.call(100).bucket] == ["long", "long"]
    short_route = short_one.call(100)
    assert short_route.bucket == "short"
    assert long_one.last is not None and long_one.last.priority is not None
    assert short_route.priority is not None and short_route.priority < long_one.last.priority
    assert LengthPrediction(Router(fleet())).predictor.total("t", 500) == (0.0, 0)


def test_capacity_weighed_least_loaded_gives_larger_instances_more_calls() -> None:
    plain, weighed = LeastLoadedScheduler(Router(fleet())), LeastLoadedCapacity(Router(fleet()))
    for policy in (plain, weighed):
        for index in range(16):
            policy.route(RouteRequest(f"t/{index}#0", f"t/{index}", 0, 500, env="t"))
    counts = plain.calls_in_flight()
    assert counts == {"a1": 4, "a2": 4, "b": 4, "c": 4}  # a count, blind to size
    weighed_counts = weighed.calls_in_flight()
    assert weighed_counts["c"] >= weighed_counts["b"] > weighed_counts["a1"]  # 8, 8, 4 slots
    assert sum(weighed_counts.values()) == 16


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
