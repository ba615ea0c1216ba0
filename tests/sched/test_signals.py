"""Tool returns mapped to scheduler states, per env."""

from __future__ import annotations

from libra.sched import SignalMap, SignalRule
from libra.signals import ToolSignal


def test_tool_returns_become_states_per_env_rules() -> None:
    signals = SignalMap(
        envs={"swe": [SignalRule(tool="view_*", action="ignore")]},
        default=[SignalRule(tool="run_tests", state="{tool}:{status}")],
    )
    view = ToolSignal("view_file", "large", "success")
    tests = ToolSignal("run_tests", "large", "failure")
    search = ToolSignal("search", "medium", "timeout")
    assert signals.state("swe", view) is None
    assert signals.state("math", view) == "view_file:large:success"
    assert signals.state("swe", tests) == "run_tests:failure"
    assert signals.state("swe", search) == "search:medium:timeout"
    only_failures = SignalRule(status="success", action="ignore")
    assert SignalMap(default=[only_failures]).state("x", view) is None
