"""A rollout's timeline: calls in flight per endpoint and trajectories ended, sampled over
time, and its plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest
from trio.testing import MockClock

from libra.cli._timeline import Timeline, plot_timeline, record_timeline
from libra.engine import RolloutStats
from libra.fleet import Endpoint, InstanceSpec
from libra.sched import RouteRequest
from libra.sched.policies import LeastLoadedScheduler

SHORT, LONG = Endpoint("http://a", name="short"), Endpoint("http://b", name="long")


def call(scheduler: LeastLoadedScheduler) -> None:
    scheduler.route(RouteRequest("t/1#0", "t/1", 0, 100, env="t"))


def test_samples_note_calls_and_endings_and_an_endpoint_seen_late_had_none_before(
    tmp_path: Path,
) -> None:
    timeline, stats = Timeline(), RolloutStats()
    one = LeastLoadedScheduler([SHORT])
    call(one)
    timeline.sample(0.0, one, stats)
    stats.statuses["completed"] += 1
    stats.reward_sum, stats.rewarded = 1.0, 1
    grown = LeastLoadedScheduler([SHORT, LONG])  # the fleet grew between samples
    call(grown)
    call(grown)
    timeline.sample(0.5, grown, stats)
    assert timeline.seconds == [0.0, 0.5]
    assert timeline.calls_in_flight == {"short": [1, 1], "long": [0, 1]}
    assert timeline.ended == {"completed": [0, 1], "truncated": [0, 0], "failed": [0, 0]}
    assert timeline.reward_mean == [None, 1.0]
    picture = tmp_path / "plots" / "timeline.png"
    plot_timeline(timeline, picture, "a rollout", {"short": "bucket short"})
    assert picture.read_bytes().startswith(b"\x89PNG")


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, Any]]:
    return "trio", {"clock": MockClock(autojump_threshold=0)}


@pytest.mark.anyio
async def test_recording_samples_every_interval_until_cancelled() -> None:
    timeline = Timeline()
    with anyio.move_on_after(0.9):
        await record_timeline(timeline, LeastLoadedScheduler([SHORT]), RolloutStats(), 0.25)
    assert timeline.seconds == pytest.approx([0.0, 0.25, 0.5, 0.75])
    assert timeline.calls_in_flight == {"short": [0, 0, 0, 0]}


def test_every_series_has_a_sample_per_tick_while_instances_join_and_leave() -> None:
    policy = LeastLoadedScheduler([Endpoint("http://x", name="x")])
    timeline, stats = Timeline(), RolloutStats()
    timeline.sample(0.0, policy, stats)
    policy.router.add_instance(InstanceSpec(name="y", url="http://y"), "all")
    policy.route(RouteRequest("t/0#0", "t/0", 0, 10, env="t"))
    timeline.sample(1.0, policy, stats)
    policy.router.remove("x", force=True)
    timeline.sample(2.0, policy, stats)
    assert timeline.calls_in_flight == {"x": [0, 1, 0], "y": [0, 0, 0]}
