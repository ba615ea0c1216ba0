"""The calculator env: seeded tasks scored exactly, and arithmetic with nothing else."""

from __future__ import annotations

from fractions import Fraction

import pytest

from envs_contrib.calc import Calc, evaluate
from libra.envs import ToolError


def test_calc_tasks_are_seeded_and_scored_exactly() -> None:
    first, again, other = Calc(), Calc(), Calc()
    assert first.reset(11) == again.reset(11) != other.reset(12)
    assert first.reward(f"The answer is {first.expected}.") == 1.0
    assert first.reward(f"The answer is {first.expected + 1}.") == 0.0
    assert first.reward("no idea") == 0.0


@pytest.mark.parametrize(
    ("expression", "value"),
    [("(12*7)-5", 79), ("7/2", Fraction(7, 2)), ("2**10", 1024), ("-3 + +4", 1), ("17 % 5", 2)],
)
def test_calculator_evaluates_arithmetic(expression: str, value: Fraction) -> None:
    assert evaluate(expression) == value


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("__import__('os').system('id')", "only numbers"),
        ("(1).__class__", "only numbers"),
        ("1/0", "division by zero"),
        ("9**9**9", "exponents must be whole numbers up to 64"),
        ("10**60 * 10**60", "too large"),
        ("2 +", "cannot parse"),
        ("True + 1", "only numbers"),
    ],
)
def test_calculator_refuses_everything_else(expression: str, message: str) -> None:
    with pytest.raises(ToolError, match=message):
        evaluate(expression)


def test_calculator_formats_results() -> None:
    assert Calc().calculator("7/2") == "3.5"
    assert Calc().calculator("6*7") == "42"
