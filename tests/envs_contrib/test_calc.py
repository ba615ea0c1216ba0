"""The contributed envs: seeded tasks, tools and rewards."""

from __future__ import annotations

from fractions import Fraction

import pytest

from envs_contrib.calc import Calc, evaluate
from envs_contrib.guess import Guess
from envs_contrib.python_math import PythonMath
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


def test_guess_answers_and_ends() -> None:
    env = Guess()
    env.reset(5)
    secret = env.secret
    assert env.guess(secret - 1) == "higher" if secret > 1 else True
    assert env.guess(secret) == "correct" and env.done
    assert env.reward("") == 1.0
    with pytest.raises(ToolError):
        env.guess(0)


def test_python_math_reads_code_blocks_as_calls() -> None:
    parse = PythonMath.tool_call_parser.parse
    [call] = parse("Let me compute.\n```python\nprint(6 * 7)\n```\nDone.")
    assert (call.name, call.arguments) == ("run_python", {"code": "print(6 * 7)\n"})
    [hermes] = parse('<tool_call>{"name": "run_python", "arguments": {"code": "1"}}</tool_call>')
    assert hermes.arguments == {"code": "1"}
    assert parse("The answer is 42.") == []


def test_python_math_runs_a_program_whose_opening_fence_is_missing() -> None:
    parse = PythonMath.tool_call_parser.parse
    [call] = parse("x = 6 * 7\nprint(x)\n```\n")
    assert call.arguments == {"code": "x = 6 * 7\nprint(x)\n"}
    [escapes] = parse('print("\\d")\n```')  # a SyntaxWarning, not an error
    assert escapes.arguments == {"code": 'print("\\d")\n'}
    # Prose before a fence is an opening fence cut short, not a program.
    assert parse("Here is the program:\n```\n") == []
    assert parse("print(1)\n```\nand then\n```\n") == []


def test_python_math_tasks_are_seeded() -> None:
    env = PythonMath()
    assert env.reset(1) == PythonMath().reset(1)
    assert env.reward(f"so the answer is {env.expected:,}.") == 1.0
