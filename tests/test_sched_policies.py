"""Each policy's decisions on constructed cases, through the scheduler protocol only."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from libra.fleet import FleetSpec
from libra.sched import Route, Router, RouteRequest, Scheduler
from libra.sched.policies import (
    CMLFQ,
    PLAS,
    POLICIES,
    CMLFQConfig,
    LeastLoadedScheduler,
    LengthPrediction,
    Oracle,
    RoundRobin,
    RoutedPolicy,
    SortedLength,
    StaticPrompt,
    TreeConfig,
    make_policy,
    reference_cost,
    reference_simple,
)
from libra.signals import ToolSignal

from .test_sched_router import fleet

FAIL = ToolSignal("run_tests", "large", "failure")
PASS = ToolSignal("run_tests", "small", "success")


class Trajectory:
    """Drives one trajectory through a policy as the engine would."""

    def __init__(self, policy: Scheduler, tid: str) -> None:
        self.policy, self.tid, self.prompt = policy, tid, tid.split("#")[0]
        self.turn = self.generated = 0
        self.context = 500
        self.last: Route | None = None

    def call(self, tokens: int, exclude: frozenset[str] = frozenset()) -> Route:
        previous = self.last.endpoint if self.last is not None else None
        request = RouteRequest(
            self.tid, self.prompt, self.turn, self.context, previous, self.generated
        )
        route = self.policy.route(request, exclude)
        self.policy.release(route, outcome="ok", new_tokens=tokens)
        self.turn += 1
        self.generated += tokens
        self.context += tokens
        self.last = route
        return route

    def tool(self, signal: ToolSignal) -> None:
        self.policy.on_tool_return(self.tid, signal)
        self.context += 2000

    def finish(self) -> None:
        self.policy.on_finish(self.tid, self.prompt, output_tokens=self.generated)

    def play(self, turns: Sequence[tuple[int, ToolSignal | None]]) -> list[Route]:
        routes = []
        for tokens, signal in turns:
            routes.append(self.call(tokens))
            if signal is not None:
                self.tool(signal)
        self.finish()
        return routes


def teach(policy: RoutedPolicy, count: int = 6) -> None:
    """History: a failing first check means ~20k more tokens; a passing one, ~200."""
    for index in range(count):
        Trajectory(policy, f"old/{index}#0").play([(1000, FAIL), (20000, PASS), (200, None)])
        Trajectory(policy, f"old/{index}#1").play([(1000, PASS), (200, None)])


def cmlfq(config: CMLFQConfig) -> CMLFQ:
    tree = TreeConfig(min_samples=3)
    return CMLFQ(Router(fleet()), config.model_copy(update={"tree": tree}))


# ---------------------------------------------------------------------- baselines


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


# ------------------------------------------------------------------------- C-MLFQ


def test_reference_rule_starts_short_and_moves_on_a_failing_check() -> None:
    policy = cmlfq(reference_simple())
    teach(policy)
    trajectory = Trajectory(policy, "new/1#0")
    assert trajectory.call(1000).bucket == "short"
    trajectory.tool(FAIL)
    moved = trajectory.call(100)
    assert moved.bucket == "long" and moved.priority is None
    decision = policy.decisions[-1]
    assert (decision.from_bucket, decision.to_bucket, decision.reason) == (
        "short",
        "long",
        "to_longer",
    )
    assert decision.moved and decision.changed_bucket
    trajectory.tool(PASS)  # the tests pass: a short answer is all that is left
    assert trajectory.call(100).bucket == "short"
    assert policy.decisions[-1].reason == "to_shorter"


def test_reference_rule_stays_when_mean_and_p90_disagree() -> None:
    policy = cmlfq(reference_simple())
    for index in range(4):  # after a failure: usually 2k more, sometimes 25k
        tail = 25000 if index == 0 else 2000
        Trajectory(policy, f"old/{index}#0").play([(500, FAIL), (tail, None)])
    trajectory = Trajectory(policy, "new/1#0")
    trajectory.call(500)
    trajectory.tool(FAIL)
    assert trajectory.call(100).bucket == "short"  # mean 7,625: medium; p90 25,000: long
    assert policy.decisions[-1].reason == "mean_p90_disagree"


def test_reference_cost_form_prefers_the_fastest_instance_with_room() -> None:
    policy = cmlfq(reference_cost())
    teach(policy)
    trajectory = Trajectory(policy, "new/1#0")
    trajectory.call(1000)
    trajectory.tool(FAIL)
    assert trajectory.call(100).endpoint.name == "c"  # 20k tokens: TP4 decodes fastest
    policy.router.by_name["c"].in_flight += 12  # 8 slots and a queue of 4: full
    other = Trajectory(policy, "new/2#0")
    other.call(1000)
    other.tool(FAIL)
    assert other.call(100).endpoint.name == "b"


def test_finish_rule_gives_stragglers_the_fast_instance_and_keeps_others_off_it() -> None:
    policy = cmlfq(CMLFQConfig())
    teach(policy)
    straggler = Trajectory(policy, "new/1#0")
    straggler.call(1000)
    straggler.tool(FAIL)
    slow = straggler.call(100)
    assert slow.endpoint.name == "c"
    quick = Trajectory(policy, "new/2#0")
    quick.call(1000)
    quick.tool(PASS)
    route = quick.call(100)
    assert route.endpoint.name != "c"  # it would slow the straggler down for nothing
    # Shortest first inside a server: the quick one's calls are admitted first.
    assert route.priority is not None and slow.priority is not None
    assert route.priority < slow.priority


def test_finish_rule_priorities_follow_the_configured_order() -> None:
    for order, sign in (("shortest_first", 1), ("longest_first", -1)):
        policy = cmlfq(CMLFQConfig(priority=order))
        teach(policy)
        long_one, short_one = Trajectory(policy, "n/1#0"), Trajectory(policy, "n/2#0")
        long_one.call(1000)
        long_one.tool(FAIL)
        short_one.call(1000)
        short_one.tool(PASS)
        long_priority = long_one.call(10).priority
        short_priority = short_one.call(10).priority
        assert long_priority is not None and short_priority is not None
        assert sign * (long_priority - short_priority) > 0
    unprioritised = cmlfq(CMLFQConfig(priority="none"))
    assert unprioritised.route(RouteRequest("x/1#0", "x/1", 0, 9)).priority is None


def test_finish_rule_places_new_trajectories_by_load_unless_told_to_start_short() -> None:
    free = cmlfq(CMLFQConfig())
    assert Trajectory(free, "n/1#0").call(10).endpoint.name == "c"  # nothing is known: fastest
    reference_start = cmlfq(CMLFQConfig(start_in_shortest=True))
    assert Trajectory(reference_start, "n/1#0").call(10).bucket == "short"
    assert reference_start.decisions[-1].reason == "start"


def test_cmlfq_learns_from_finished_trajectories_and_forgets_them() -> None:
    policy = cmlfq(CMLFQConfig())
    Trajectory(policy, "t/1#0").play([(700, FAIL), (300, None)])
    assert policy.tracks == {} and policy.router.home == {}
    assert policy.forest is not None
    assert policy.forest.global_tree.root.samples.values.tolist() == [1000]
    assert policy.reasons.total() == len(policy.decisions) == 2


# ------------------------------------------------------------------------- factory


def test_every_policy_is_made_by_name() -> None:
    spec: FleetSpec = fleet()
    totals = {"t/1#0": 100}
    for name in POLICIES:
        policy = make_policy(name, spec, truth=totals.__getitem__)
        Trajectory(policy, "t/1#0").play([(50, PASS), (50, None)])
    assert isinstance(make_policy("least-loaded", spec), LeastLoadedScheduler)
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("fifo", spec)
    with pytest.raises(ValueError, match="needs the true lengths"):
        make_policy("oracle", spec)
