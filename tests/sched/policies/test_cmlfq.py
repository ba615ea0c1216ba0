"""C-MLFQ's decisions on constructed cases, through the scheduler protocol only."""

from __future__ import annotations

from libra.sched import Router, RouteRequest
from libra.sched.policies import (
    ABLATIONS,
    CMLFQ,
    REGISTRY,
    CMLFQConfig,
    PolicyOptions,
    RoutedPolicy,
    TreeConfig,
    reference_cost,
    reference_simple,
)
from tests._helpers import FAIL, PASS, Trajectory, fleet


def teach(policy: RoutedPolicy, count: int = 6) -> None:
    """History: a failing first check means ~20k more tokens; a passing one, ~200."""
    for index in range(count):
        Trajectory(policy, f"old/{index}#0").play([(1000, FAIL), (20000, PASS), (200, None)])
        Trajectory(policy, f"old/{index}#1").play([(1000, PASS), (200, None)])


def cmlfq(config: CMLFQConfig) -> CMLFQ:
    tree = TreeConfig(min_samples=3)
    return CMLFQ(Router(fleet()), config.model_copy(update={"tree": tree}))


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


def test_a_move_to_a_shorter_bucket_is_priced_by_the_demotion_quantile() -> None:
    """After a failing check 19 of 20 trajectories wrote 300 tokens more and one 20,000:
    p90 says 300, p97 says 20,000. The TP4 is busy with trajectories expected to write
    5,000 more, so priced at p90 (the default) the new one would finish first on the TP2;
    priced at p97, where it would run 20,000 tokens on a slower instance, it stays."""
    only_c = frozenset({"a1", "a2", "b"})
    landed: dict[float | None, tuple[str, str]] = {}
    for quantile in (None, 0.97):
        tree = TreeConfig(min_samples=3, demote_quantile=quantile)
        policy = CMLFQ(Router(fleet()), CMLFQConfig(tree=tree))
        for index in range(20):
            tail = 20_000 if index == 0 else 300
            Trajectory(policy, f"old/{index}#0").play([(500, FAIL), (tail, None)])
            Trajectory(policy, f"long/{index}#0").play([(500, PASS), (5_000, None)])
        for index in range(7):
            resident = Trajectory(policy, f"busy/{index}#0")
            resident.call(500, only_c)
            resident.tool(PASS)
            resident.call(100, only_c)
        trajectory = Trajectory(policy, "new/1#0")
        trajectory.call(500, only_c)
        trajectory.tool(FAIL)
        landed[quantile] = (trajectory.call(100).endpoint.name, policy.decisions[-1].reason)
        assert policy.decisions[-1].expected_upper == 300  # the p90 it reports
    assert landed == {None: ("b", "to_shorter"), 0.97: ("c", "stay")}


def test_a_turn_past_its_quantum_goes_on_in_its_bucket_or_a_longer_one() -> None:
    policy = cmlfq(CMLFQConfig(quantum_tokens=150))
    teach(policy)
    straggler = Trajectory(policy, "new/1#0")
    straggler.call(1000)
    straggler.tool(FAIL)
    assert straggler.call(100).endpoint.name == "c"
    quick = Trajectory(policy, "new/2#0")
    quick.call(1000)
    quick.tool(PASS)  # ~200 tokens left: a turn starting now is kept off "c" (see above)
    started = quick.call(150, exclude=frozenset({"a1", "a2", "b"}))  # it starts on "c"
    assert (started.endpoint.name, started.max_tokens) == ("c", 150)
    quick.turn -= 1  # it outran its quantum: the same turn goes on
    assert quick.call(30).endpoint.name == "c"  # not moved to a shorter bucket mid-turn
    assert policy.decisions[-1].reason == "stay"


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
    assert unprioritised.route(RouteRequest("x/1#0", "x/1", 0, 9, env="x")).priority is None


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


def test_each_ablation_takes_out_its_one_mechanism() -> None:
    config = CMLFQConfig(tree=TreeConfig(min_samples=3))
    options = PolicyOptions(config=config)
    made = {name: REGISTRY[name].create(Router(fleet()), options) for name in ABLATIONS}
    assert set(made) == {
        "cmlfq-no-signal",
        "cmlfq-no-priority",
        "cmlfq-no-quantum",
        "cmlfq-history",
    }
    for policy in made.values():
        assert isinstance(policy, CMLFQ)
        teach(policy)
    routes = {}
    for name, policy in made.items():
        straggler = Trajectory(policy, "new/1#0")
        straggler.call(1000)
        straggler.tool(FAIL)
        routes[name] = straggler.call(100)
        assert isinstance(policy, CMLFQ)
        track_path = policy.tracks["new/1#0"].path
        assert track_path == ([] if name == "cmlfq-no-signal" else ["run_tests:large:failure"])
    assert routes["cmlfq-no-priority"].priority is None
    assert routes["cmlfq-no-signal"].priority is not None
    assert routes["cmlfq-no-quantum"].max_tokens is None
    assert routes["cmlfq-no-signal"].max_tokens == CMLFQConfig().quantum_tokens
    # Without the tree's paths a failing check says nothing: the estimate is the mean of
    # every trajectory seen (21,200 and 1,200 tokens), less the 1,000 generated.
    history = made["cmlfq-history"]
    assert isinstance(history, CMLFQ) and history.forest is None
    estimate = history.tracks["new/1#0"].estimate
    assert estimate is not None and estimate.source == "history"
    assert estimate.mean == 11_200 - 1_000
