"""The live fleet: instances and buckets join, drain and leave while calls are in flight;
calls release with their outcome; policies keep no reference to an instance that left."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from libra.emulation import EmulatorConfig, LatencyModel, create_app
from libra.engine._asgi import ASGITransport
from libra.fleet import BucketSpec, Endpoint, FleetSpec, InstanceSpec
from libra.sched import NoEndpointAvailable, Route, Router, RouteRequest, poll_once
from libra.sched.policies import (
    CMLFQ,
    POLICIES,
    REGISTRY,
    LeastLoadedScheduler,
    RoutedPolicy,
    Truth,
    make_policy,
)
from libra.signals import ToolSignal


def spec(name: str, **fields: Any) -> InstanceSpec:
    fields.setdefault("url", f"http://{name}")
    return InstanceSpec(name=name, **fields)


def two_buckets() -> FleetSpec:
    """Short: a1, a2 (TP1); long: c (TP4)."""
    return FleetSpec(
        instances=[spec("a1"), spec("a2"), spec("c", tp=4)],
        buckets=[
            BucketSpec(name="short", max_tokens=4_000, instances=["a1", "a2"]),
            BucketSpec(name="long", max_tokens=30_000, instances=["c"]),
        ],
    )


def request(trajectory: str, context: int = 1000, previous: Endpoint | None = None) -> RouteRequest:
    return RouteRequest(trajectory, trajectory.split("#")[0], 0, context, previous, env="t")


def call(router: Router, name: str, trajectory: str = "t/0#0") -> Route:
    return router.acquire(router.by_name[name], request(trajectory))


# ---------------------------------------------------------------------- membership


def test_an_added_instance_takes_calls_and_buckets_stay_ordered() -> None:
    router = Router(two_buckets())
    router.add_bucket("medium", 12_000)
    router.add_instance(spec("b", tp=2), "medium")
    assert [(b.name, b.index) for b in router.buckets] == [("short", 0), ("medium", 1), ("long", 2)]
    instance, why = router.pick(router.bucket_of["medium"], request("t/1#0"))
    assert (instance.name, why) == ("b", "ok")
    with pytest.raises(ValueError, match="active"):
        router.add_instance(spec("b"), "short")
    with pytest.raises(ValueError, match="still holds"):
        router.remove_bucket("medium")


def test_a_draining_instance_takes_no_calls_and_says_when_its_last_call_is_done() -> None:
    router = Router(two_buckets())
    first, second = call(router, "a1", "t/1#0"), call(router, "a1", "t/2#0")
    drained = router.drain("a1")
    assert router.by_name["a1"].state == "draining" and not drained.is_set()
    for _ in range(4):
        instance, _ = router.pick(router.bucket_of["short"], request("t/3#0"))
        assert instance.name == "a2"
    router.release(first, outcome="failed")  # whatever the outcome: the call is over
    assert not drained.is_set()
    assert router.by_name["a1"].state == "draining"  # never touched by a release
    router.release(second, outcome="cancelled")
    assert drained.is_set()
    router.remove("a1")
    assert "a1" not in router.by_name and "a1" not in router.endpoints()
    assert [i.name for i in router.bucket_of["short"].instances] == ["a2"]


def test_residents_of_a_draining_instance_are_rehomed() -> None:
    router = Router(two_buckets())
    router.release(call(router, "a1", "t/1#0"), outcome="ok")
    assert router.home["t/1#0"].name == "a1"
    router.drain("a1")
    assert "t/1#0" not in router.home and not router.by_name["a1"].residents
    route = router.acquire(router.by_name["a2"], request("t/1#0"))
    assert router.home["t/1#0"] is route.instance


@pytest.mark.anyio
async def test_the_drained_latch_wakes_a_waiter() -> None:
    router = Router(two_buckets())
    route = call(router, "c")
    done: list[bool] = []

    async def retire() -> None:
        await router.retire("c")
        done.append(True)

    async with anyio.create_task_group() as group:
        group.start_soon(retire)
        await anyio.sleep(0.01)
        assert not done and router.by_name["c"].state == "draining"
        router.release(route, outcome="ok")
    assert done and "c" not in router.by_name


def test_remove_refuses_calls_in_flight_unless_forced_and_a_new_incarnation_is_safe() -> None:
    router = Router(two_buckets())
    old = call(router, "a1")
    with pytest.raises(ValueError, match="drain it"):
        router.remove("a1")
    router.remove("a1", force=True)
    again = router.add_instance(spec("a1"), "short")
    router.release(old, outcome="failed")  # counted on the gone incarnation, not this one
    assert again.in_flight == 0 and again.failures == 0 and again.state == "active"
    assert old.instance is not again and old.retired


def test_removing_the_last_bucket_member_then_the_bucket() -> None:
    router = Router(two_buckets())
    router.drain("c")
    router.remove("c")
    router.remove_bucket("long")
    assert [b.name for b in router.buckets] == ["short"]
    assert router.bucket_for_tokens(10**6).name == "short"


def test_apply_keeps_live_instances_moves_adds_and_drains() -> None:
    router = Router(two_buckets())
    a1, a2 = router.by_name["a1"], router.by_name["a2"]
    busy = call(router, "a2")
    new = FleetSpec(
        instances=[spec("a1"), spec("a2"), spec("d", tp=2)],
        buckets=[
            BucketSpec(name="short", max_tokens=4_000, instances=["a1"]),
            BucketSpec(name="medium", max_tokens=12_000, instances=["a2", "d"]),
        ],
    )
    drains = router.apply(new)
    assert set(drains) == {"c"} and drains["c"].is_set()  # nothing in flight there
    assert router.by_name["a1"] is a1 and router.by_name["a2"] is a2  # the same objects
    assert a2.bucket == "medium" and a2.in_flight == 1  # its load moved with it
    assert [b.name for b in router.buckets] == ["short", "medium"]
    assert [i.name for i in router.bucket_of["medium"].instances] == ["a2", "d"]
    assert router.by_name["c"].state == "draining"
    router.remove("c")
    router.release(busy, outcome="ok")
    assert a2.in_flight == 0
    moved = new.model_copy(
        update={"instances": [spec("a1"), spec("a2"), spec("d", url="http://x")]}
    )
    with pytest.raises(ValueError, match="changes server"):
        router.apply(moved)


def test_an_empty_fleet_raises_and_a_joining_instance_wakes_waiters() -> None:
    router = Router(FleetSpec(instances=[spec("only")]))
    router.drain("only")
    with pytest.raises(NoEndpointAvailable, match="only draining"):
        router.pick(router.shortest, request("t/1#0"))
    router.remove("only")
    with pytest.raises(NoEndpointAvailable, match="empty"):
        router.pick(router.shortest, request("t/1#0"))


@pytest.mark.anyio
async def test_membership_pulse_fires_when_an_instance_joins() -> None:
    router = Router(FleetSpec(instances=[spec("only")]))
    router.remove("only")
    woke: list[float] = []

    async def waiter() -> None:
        await router.membership.wait()
        woke.append(anyio.current_time())

    async with anyio.create_task_group() as group:
        group.start_soon(waiter)
        await anyio.sleep(0.01)
        assert not woke
        router.add_instance(spec("new"), "all")
    assert woke
    assert router.pick(router.shortest, request("t/1#0"))[0].name == "new"


# ------------------------------------------------------------------------ outcomes


@pytest.mark.parametrize("outcome", ["rejected", "cancelled", "migrated"])
def test_only_a_server_failure_marks_an_instance_down(outcome: Any) -> None:
    router = Router(two_buckets())
    router.release(call(router, "a1"), outcome=outcome)
    assert router.by_name["a1"].failures == 0
    assert not router.by_name["a1"].is_down(router.clock())
    router.release(call(router, "a1"), outcome="failed")
    assert router.by_name["a1"].failures == 1
    assert router.pick(router.bucket_of["short"], request("t/1#0"))[0].name == "a2"


def test_an_ok_call_ends_a_cooldown_but_not_a_health_checks_verdict() -> None:
    router = Router(two_buckets())
    router.release(call(router, "a1"), outcome="failed")
    router.release(call(router, "a1"), outcome="ok")
    assert not router.by_name["a1"].is_down(router.clock())
    router.mark_down("a2")
    router.release(call(router, "a2"), outcome="ok")
    assert router.by_name["a2"].is_down(router.clock())


def test_when_every_instance_is_cooling_down_they_are_tried_again() -> None:
    router = Router(FleetSpec(instances=[spec("x"), spec("y")]))
    router.release(call(router, "x"), outcome="failed")
    assert [i.name for i in router.available()] == ["y"]
    router.release(call(router, "y"), outcome="failed")
    assert [i.name for i in router.available()] == ["x", "y"]  # cooldowns: a preference
    router.mark_down("x")
    router.mark_down("y")
    assert router.available() == []  # a health check's verdict: a ban


def test_a_release_twice_counts_once() -> None:
    router = Router(two_buckets())
    route = call(router, "a1")
    call(router, "a1", "t/1#0")
    router.release(route, outcome="ok")
    router.release(route, outcome="ok")
    assert router.by_name["a1"].in_flight == 1


# ----------------------------------------------------------------- weight version


def test_the_weight_version_is_taken_at_routing_and_shared_with_weight_sync() -> None:
    router = Router(two_buckets())
    route = call(router, "a1")
    assert (route.weight_version, route.weights_changed) == (0, False)
    router.endpoints()["a1"].weight_version = 1  # what a weight sync does
    assert route.weights_changed and route.weight_version == 0
    assert call(router, "a1").weight_version == 1


def test_least_loaded_routes_over_the_very_endpoints_it_is_given() -> None:
    endpoints = [Endpoint("http://x", name="x"), Endpoint("http://y", name="y")]
    policy = LeastLoadedScheduler(endpoints)
    assert list(policy.router.endpoints().values()) == endpoints
    endpoints[1].weight_version = 7
    routes = [policy.route(request(f"t/{i}#0")) for i in range(2)]
    assert {r.endpoint.name: r.weight_version for r in routes} == {"x": 0, "y": 7}


# ----------------------------------------------------------- policies after removal


def test_least_loaded_survives_a_removed_endpoint() -> None:
    policy = LeastLoadedScheduler([Endpoint("http://x", name="x"), Endpoint("http://y", name="y")])
    routes = [policy.route(request(f"t/{i}#0")) for i in range(4)]
    policy.router.remove("x", force=True)
    for route in routes:
        policy.release(route, outcome="ok", new_tokens=5)  # no KeyError for the gone one
    assert policy.calls_in_flight() == {"y": 0}
    assert policy.route(request("t/9#0")).endpoint.name == "y"


FAIL = ToolSignal("run_tests", "large", "failure")


def assert_no_reference(policy: RoutedPolicy, gone: set[str]) -> None:
    router = policy.router
    assert not gone & set(router.by_name) and not gone & {i.name for i in router.instances}
    assert all(i.name not in gone for i in router.home.values())
    assert all(t.instance is None or t.instance.name not in gone for t in policy.tracks.values())
    for bucket in router.buckets:
        assert all(i.name not in gone for i in bucket.instances)


@pytest.mark.parametrize("name", ["cmlfq", "cmlfq-ref", "cmlfq-cost", "plas", "length-pred"])
def test_policies_hold_no_removed_instance_and_route_on(name: str) -> None:
    truth = Truth.of_totals({f"t/{i}#0": 1000 for i in range(12)})
    policy = make_policy(name, two_buckets(), truth=truth)
    routes = {f"t/{i}#0": policy.route(request(f"t/{i}#0")) for i in range(12)}
    for trajectory, route in routes.items():
        policy.release(route, outcome="ok", new_tokens=300)
        policy.on_tool_return(trajectory, FAIL)
    homes = {instance.name for instance in policy.router.home.values()}
    assert homes & {"a1", "c"}  # trajectories live where instances will leave
    in_flight = [policy.route(request(t, 2000, r.endpoint)) for t, r in routes.items()]
    policy.router.drain("c")
    policy.router.remove("a1", force=True)
    for route in in_flight:
        policy.release(route, outcome="migrated", new_tokens=10)
    policy.router.remove("c")
    policy.router.remove_bucket("long")
    assert_no_reference(policy, {"a1", "c"})
    for trajectory, route in routes.items():
        again = policy.route(request(trajectory, 3000, route.endpoint))
        assert again.endpoint.name == "a2"
        policy.release(again, outcome="ok", new_tokens=10)
    for index, trajectory in enumerate(routes):
        failed = index % 2 == 0  # a failed trajectory is forgotten as well
        policy.on_finish(trajectory, trajectory.split("#")[0], output_tokens=320, failed=failed)
    assert policy.tracks == {} and policy.router.home == {}
    assert getattr(policy, "bucket_by_trajectory", {}) == {}


def test_cmlfq_decisions_name_instances_and_hold_none() -> None:
    policy = make_policy("cmlfq", two_buckets())
    assert isinstance(policy, CMLFQ)
    policy.release(policy.route(request("t/1#0")), outcome="ok", new_tokens=10)
    assert all(isinstance(d.to_instance, str) for d in policy.decisions)


# --------------------------------------------------------------------- registry


def test_policies_register_by_name_in_the_order_reports_list_them() -> None:
    assert POLICIES == (
        "round-robin",
        "least-loaded",
        "least-loaded-capacity",
        "static-prompt",
        "length-pred",
        "sorted",
        "plas",
        "cmlfq-ref",
        "cmlfq-cost",
        "cmlfq",
        "cmlfq-fit",
        "cmlfq-no-signal",
        "cmlfq-no-priority",
        "cmlfq-no-quantum",
        "cmlfq-history",
        "oracle",
        "oracle-finish",
        "oracle-simple",
    )
    assert all(REGISTRY[name].name == name for name in POLICIES)
    assert isinstance(make_policy("least-loaded", two_buckets()), RoutedPolicy)


def test_apply_checks_everything_before_changing_anything() -> None:
    router = Router(two_buckets())
    busy = call(router, "c")
    router.drain("c")
    back = two_buckets().model_copy(update={"max_queue_length": 9})
    with pytest.raises(ValueError, match="draining"):
        router.apply(back)
    assert router.fleet.max_queue_length == 3 and [b.name for b in router.buckets] == [
        "short",
        "long",
    ]
    router.release(busy, outcome="ok")
    router.remove("c")
    assert set(router.apply(back)) == set() and router.by_name["c"].state == "active"


@pytest.mark.anyio
async def test_polling_metrics_while_instances_leave() -> None:
    router = Router(FleetSpec(instances=[spec("x"), spec("y"), spec("z")]))
    app = create_app(EmulatorConfig(latency=LatencyModel()))

    async def fleet_app(scope: Any, receive: Any, send: Any) -> None:
        host = scope["server"][0]
        if host == "x":  # while the poller waits on x, y and z leave (z unreachable)
            router.remove("y")
            router.remove("z")
        if host == "z":
            raise ConnectionError("no route to host")
        await app(scope, receive, send)

    async with ASGITransport(fleet_app) as http:
        await poll_once(router, lambda url: http.get(url, 5.0))
    assert [i.name for i in router.instances] == ["x"]
    assert router.by_name["x"].waiting_gauge == 0.0
