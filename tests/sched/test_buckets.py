"""The router: buckets, live load, stickiness, fallbacks when instances are full or down."""

from __future__ import annotations

from typing import Any

import pytest

from libra.sched import (
    NoEndpointAvailable,
    Router,
    RouteRequest,
)
from tests._helpers import fleet


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def request(trajectory: str = "t/1#0", context: int = 1000, previous: Any = None) -> RouteRequest:
    return RouteRequest(trajectory, trajectory.split("#")[0], 0, context, previous, env="t")


def fill(router: Router, name: str, calls: int, context: int = 1000) -> None:
    for index in range(calls):
        router.acquire(router.by_name[name], request(f"filler/{name}#{index}", context))


def test_buckets_are_ordered_shortest_first_and_cover_tokens() -> None:
    router = Router(fleet())
    assert [b.name for b in router.buckets] == ["short", "medium", "long"]
    assert router.shortest.name == "short"
    assert router.bucket_for_tokens(100).name == "short"
    assert router.bucket_for_tokens(4001).name == "medium"
    assert router.bucket_for_tokens(10**9).name == "long"  # nothing covers it: the largest


def test_least_loaded_inside_a_bucket_and_the_calls_are_counted() -> None:
    router = Router(fleet())
    fill(router, "a1", 2)
    instance, why = router.pick(router.bucket_of["short"], request())
    assert (instance.name, why) == ("a2", "ok")
    route = router.acquire(instance, request(context=3000), priority=-2)
    assert (route.bucket, route.priority, route.trajectory_id) == ("short", -2, "t/1#0")
    assert (instance.in_flight, instance.in_flight_tokens) == (1, 3000)
    assert router.home["t/1#0"] is instance and "t/1#0" in instance.residents
    router.release(route, outcome="ok")
    assert (instance.in_flight, instance.in_flight_tokens) == (0, 0)
    router.forget("t/1#0")
    assert "t/1#0" not in instance.residents and "t/1#0" not in router.home


def test_a_trajectory_stays_on_its_instance_while_it_is_nearly_as_good() -> None:
    router = Router(fleet(sticky_slack=1.0))
    a1, a2 = router.by_name["a1"], router.by_name["a2"]
    fill(router, "a1", 1)
    assert router.pick(router.bucket_of["short"], request(previous=a1.endpoint))[0] is a1
    fill(router, "a1", 1)  # now two more calls than a2: prefix reuse is not worth the wait
    assert router.pick(router.bucket_of["short"], request(previous=a1.endpoint))[0] is a2


def test_a_full_bucket_falls_back_to_the_next_longer_one() -> None:
    router = Router(fleet(max_queue_length=2))
    for name in ("a1", "a2"):
        fill(router, name, 6)  # 4 run, 2 queue: full
    assert router.is_full(router.by_name["a1"])
    instance, why = router.pick(router.bucket_of["short"], request())
    assert (instance.name, why) == ("b", "fallback_from_short")
    fill(router, "b", 10)
    assert router.pick(router.bucket_of["short"], request())[0].name == "c"


def test_kv_capacity_fills_an_instance_before_its_batch_does() -> None:
    router = Router(fleet(max_queue_length=1))
    fill(router, "a1", 3, context=20_000)  # 60k tokens of prompt: 2 fit in 40k of KV
    a1 = router.by_name["a1"]
    assert (a1.capacity, a1.queued) == (2, 1) and router.is_full(a1)


def test_when_everything_is_full_the_least_loaded_instance_still_takes_the_call() -> None:
    router = Router(fleet(max_queue_length=1))
    for name, calls in (("a1", 6), ("a2", 6), ("b", 9), ("c", 12)):
        fill(router, name, calls)
    instance, why = router.pick(router.bucket_of["medium"], request())
    assert (instance.name, why) == ("b", "all_full")  # 9/8 beats 12/8 and 6/4


def test_an_instance_that_failed_is_avoided_until_its_cooldown_ends() -> None:
    clock = Clock()
    router = Router(fleet(down_cooldown_s=5.0), clock=clock)
    a1 = router.by_name["a1"]
    route = router.acquire(a1, request())
    router.release(route, outcome="failed")
    assert router.pick(router.bucket_of["short"], request())[0].name == "a2"
    router.mark_failed(a1)  # a second failure in a row doubles the cooldown
    clock.now = 9.0
    assert a1.is_down(clock.now)
    clock.now = 10.0
    assert router.pick(router.bucket_of["short"], request())[0] is a1  # tie: fleet order
    route = router.acquire(a1, request())
    router.release(route, outcome="ok")
    assert a1.failures == 0


def test_a_bucket_that_is_down_falls_back_and_all_down_raises() -> None:
    router = Router(fleet())
    router.mark_down("c")
    instance, why = router.pick(router.bucket_of["long"], request())
    assert (instance.name, why) == ("b", "fallback_from_long")
    for name in ("a1", "a2", "b"):
        router.mark_down(name)
    with pytest.raises(NoEndpointAvailable):
        router.pick(router.bucket_of["short"], request())
    router.mark_down("a2", down=False)
    assert router.pick(router.bucket_of["long"], request())[0].name == "a2"


def test_the_engines_exclusions_count_as_down() -> None:
    router = Router(fleet())
    instance, why = router.pick(router.bucket_of["short"], request(), frozenset({"a1", "a2"}))
    assert (instance.name, why) == ("b", "fallback_from_short")
