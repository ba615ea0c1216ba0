"""Reading tool calls from text and from OpenAI ``tool_calls``."""

from __future__ import annotations

from libra import openai
from libra.envs import HermesToolCallParser, ToolCall, from_openai

parse = HermesToolCallParser().parse


def test_hermes_blocks() -> None:
    text = (
        'thinking <tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call> and '
        '<tool_call>{"name": "b"}</tool_call>'
    )
    assert parse(text) == [ToolCall("call_0", "a", {"x": 1}), ToolCall("call_1", "b", {})]
    assert parse("no calls here") == []


def test_arguments_given_as_a_json_string() -> None:
    [call] = parse('<tool_call>{"name": "a", "arguments": "{\\"x\\": 2}"}</tool_call>')
    assert call.arguments == {"x": 2}


def test_unterminated_and_malformed_blocks_carry_errors() -> None:
    [unterminated] = parse('<tool_call>{"name": "a", "arguments": {}}')
    assert unterminated.error is None and unterminated.name == "a"
    [bad] = parse("<tool_call>{oops}</tool_call>")
    assert bad.error is not None and "not valid JSON" in bad.error
    [no_object] = parse('<tool_call>{"name": "a", "arguments": [1]}</tool_call>')
    assert no_object.error == "the arguments must be a JSON object"


def test_openai_tool_calls() -> None:
    calls = [
        openai.ToolCall(id="c1", function=openai.FunctionCall(name="f", arguments='{"y": 3}')),
        openai.ToolCall(id="c2", function=openai.FunctionCall(name="g", arguments="{bad")),
    ]
    good, bad = from_openai(calls)
    assert good == ToolCall("c1", "f", {"y": 3})
    assert bad.name == "g" and bad.error is not None


DEEP = "[" * 5000 + "]" * 5000
LONG_NUMBER = "9" * 5000


def test_json_past_python_s_limits_is_an_error_the_model_reads() -> None:
    # Nesting past the recursion limit and a 5000-digit number are valid JSON that
    # Python's decoder refuses with other exceptions than JSONDecodeError.
    [nested] = parse(f'<tool_call>{{"name": "a", "arguments": {{"x": {DEEP}}}}}</tool_call>')
    assert nested.error == "the tool call cannot be read: it is nested too deeply"
    [number] = parse(f'<tool_call>{{"name": "a", "arguments": {{"x": {LONG_NUMBER}}}}}</tool_call>')
    assert number.error is not None
    assert number.error.startswith("the tool call cannot be read: Exceeds the limit (4300 digits)")
    calls = [
        openai.ToolCall(id="c1", function=openai.FunctionCall(name="f", arguments=DEEP)),
        openai.ToolCall(id="c2", function=openai.FunctionCall(name="f", arguments=LONG_NUMBER)),
    ]
    deep, long = from_openai(calls)
    assert deep.error == "the arguments cannot be read: it is nested too deeply"
    assert long.error is not None and long.error.startswith("the arguments cannot be read: ")
