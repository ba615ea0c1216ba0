"""Bugs in env code: the first traceback per place and exception type is shown."""

from __future__ import annotations

import io

from libra.envs import EnvBugs


def raised(error: Exception) -> Exception:
    try:
        raise error
    except Exception as caught:
        return caught


def test_each_place_and_exception_type_is_shown_once() -> None:
    stream = io.StringIO()
    bugs = EnvBugs(stream)
    for _ in range(3):
        bugs.report("tool a", raised(ValueError("one")))
    bugs.report("tool a", raised(KeyError("two")))
    bugs.report("tool b", raised(ValueError("three")))
    shown = stream.getvalue()
    assert shown.count("Traceback (most recent call last)") == 3
    headers = [line for line in shown.splitlines() if line.startswith("libra: a bug in")]
    assert [h.split(" (")[0] for h in headers] == [
        "libra: a bug in tool a: ValueError",
        "libra: a bug in tool a: KeyError",
        "libra: a bug in tool b: ValueError",
    ]
    assert "ValueError: one" in shown and "KeyError: 'two'" in shown
