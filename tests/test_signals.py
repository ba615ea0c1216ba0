"""The one reduction of a tool return to its causal signal (``libra.signals.signal_of``)."""

from __future__ import annotations

import pytest

from libra.signals import SizeClass, ToolSignal, ToolStatus, signal_of, size_class

TRACEBACK = 'Traceback (most recent call last):\n  File "<stdin>", line 1\nZeroDivisionError'


@pytest.mark.parametrize(
    ("chars", "expected"),
    [(0, "small"), (500, "small"), (501, "medium"), (5000, "medium"), (5001, "large")],
)
def test_the_size_class_follows_the_payload_length(chars: int, expected: SizeClass) -> None:
    assert size_class(chars) == expected
    assert signal_of("t", "x" * chars).size_class == expected


@pytest.mark.parametrize(
    ("text", "status"),
    [
        (TRACEBACK, "failure"),
        ("Error: division by zero", "failure"),
        ("  exception raised in the handler", "failure"),
        ("ran 3 tests\nstatus: FAILED", "failure"),
        ("3 tests passed, no errors", "success"),
        ("42", "success"),
        ("", "success"),
    ],
)
def test_a_plain_result_has_its_status_read_from_its_text(text: str, status: ToolStatus) -> None:
    assert signal_of("run", text) == ToolSignal("run", size_class(len(text)), status)


@pytest.mark.parametrize(
    ("text", "reported"),
    [
        (TRACEBACK, "success"),  # a program that prints a traceback on purpose, and exits 0
        ("all 12 tests passed", "failure"),
        ("partial output", "timeout"),
        ("Error: killed", "timeout"),
    ],
)
def test_a_reported_status_is_taken_as_it_is(text: str, reported: ToolStatus) -> None:
    assert signal_of("run", text, reported) == ToolSignal("run", "small", reported)


def test_the_size_class_comes_from_the_content_whatever_the_status() -> None:
    big = "x" * 6000
    assert [signal_of("read", big, s).size_class for s in ("success", "failure", "timeout")] == [
        "large"
    ] * 3
