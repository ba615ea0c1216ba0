"""Python math: code blocks read as calls, seeded tasks."""

from __future__ import annotations

from envs_contrib.python_math import PythonMath


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
