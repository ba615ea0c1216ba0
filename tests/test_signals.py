"""A tool's return reduced to a signal: its size class and its status."""

from __future__ import annotations

from libra.signals import size_class, status_of_output


def test_signal_reduction() -> None:
    assert [size_class(n) for n in (0, 500, 501, 5000, 5001)] == [
        "small", "small", "medium", "medium", "large"
    ]  # fmt: skip
    assert status_of_output("Traceback (most recent call last):\n  File") == "failure"
    assert status_of_output("Error: division by zero") == "failure"
    assert status_of_output("status: failed") == "failure"
    assert status_of_output("3 tests passed, no errors") == "success"
