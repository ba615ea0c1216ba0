"""The run's events put to use: the fleet as the router holds it, and where a resumed
run's events go on from."""

from __future__ import annotations

from pathlib import Path

from libra.events import EventBus, StepEnded, encode
from libra.launch._view import fleet_sample, last_t
from libra.sched.policies import make_policy
from tests._helpers import fleet


def test_the_fleet_sample_is_the_router_s_view() -> None:
    router = make_policy("cmlfq", fleet()).router
    router.by_name["a1"].in_flight = 3
    router.by_name["b"].marked_down = True
    sample = fleet_sample(EventBus(), router)
    by_name = {instance.name: instance for instance in sample.instances}
    assert set(by_name) == {"a1", "a2", "b", "c"}
    assert (by_name["a1"].bucket, by_name["a1"].in_flight) == ("short", 3)
    assert by_name["b"].state == "down" and by_name["c"].state == "active"


def test_a_resumed_run_s_events_go_on_from_its_log_s_last(tmp_path: Path) -> None:
    log = tmp_path / "events.jsonl"
    assert last_t(log) == 0.0
    lines = [encode(StepEnded(t=t, line={"step": i})) for i, t in enumerate((1.5, 42.25))]
    log.write_bytes(b"\n".join(lines) + b'\n{"kind":"step","t":')  # a line cut by a crash
    assert last_t(log) == 42.25
    assert EventBus(offset=42.25).t() >= 42.25
