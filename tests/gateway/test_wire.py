"""The public request structs: what real clients send becomes the core's ``ChatTurn``;
what cannot be honoured is a 400 naming the field."""

from __future__ import annotations

import json
from typing import Any

import pytest

from libra.gateway._protocol import ChatReply
from libra.gateway._wire_replies import Head, chat_chunks
from libra.gateway._wire_requests import (
    WireError,
    chat_turn,
    decode_chat,
    decode_completion,
    upstream_completion,
)
from libra.openai import FunctionCall, Message, ToolCall
from tests._helpers import CALCULATOR

CALL = {"id": "c1", "type": "function", "function": {"name": "calculator", "arguments": "{}"}}
TEXT = [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]
AUDIO = [{"type": "input_audio", "input_audio": {}}]
FROM_USER = [{"id": "1", "function": {"name": "f", "arguments": "{}"}}]


def body(**fields: Any) -> bytes:
    fields.setdefault("model", "m")
    fields.setdefault("messages", [{"role": "user", "content": "hi"}])
    return json.dumps(fields).encode()


def test_what_real_clients_send_becomes_a_chat_turn() -> None:
    request = decode_chat(
        body(
            messages=[
                {
                    "role": "developer",
                    "content": [
                        {"type": "text", "text": "Be "},
                        {"type": "text", "text": "brief."},
                    ],
                },
                {"role": "user", "content": "6*7?", "name": "ada"},
                {
                    "role": "assistant",
                    "content": None,
                    "refusal": None,
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "calculator", "arguments": "{}"},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "42"}]},
            ],
            tools=[CALCULATOR],
            tool_choice="auto",
            parallel_tool_calls=True,
            stop="END",
            max_tokens=99,
            max_completion_tokens=50,
            temperature=0.5,
            top_p=0.9,
            seed=3,
            n=1,
            logprobs=False,
            user="u-1",
            metadata={"run": "7"},
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    turn = chat_turn(request, None)
    assert turn.messages == [
        Message(role="system", content="Be brief."),
        Message(role="user", content="6*7?", name="ada"),
        Message(role="assistant", tool_calls=[ToolCall("c1", FunctionCall("calculator", "{}"))]),
        Message(role="tool", content="42", tool_call_id="c1"),
    ]
    assert turn.tools == [CALCULATOR]
    assert (turn.max_tokens, turn.temperature, turn.top_p, turn.seed) == (50, 0.5, 0.9, 3)
    assert turn.stop == ["END"] and turn.session == "u-1"
    assert chat_turn(request, "header-key").session == "header-key"  # the header wins
    keyed = decode_chat(body(user="u-1", metadata={"libra_session": "m-1"}))
    assert chat_turn(keyed, None).session == "m-1"  # then metadata, then user


def test_tool_choice_none_sends_no_tools() -> None:
    request = decode_chat(body(tools=[CALCULATOR], tool_choice="none", stop=["a", "b"]))
    turn = chat_turn(request, None)
    assert turn.tools == [] and turn.stop == ["a", "b"] and turn.session is None


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"presence_penalty": 1.0}, "presence_penalty", "not supported"),
        ({"wat": 1}, "wat", "Unrecognized"),
        ({"n": 3}, "n", "one choice"),
        ({"messages": []}, "messages", "at least one"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type", "Invalid"),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}
                ]
            },
            "messages[0].content[0]",
            "input_audio",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": "x",
                        "tool_calls": [{"id": "1", "function": {"name": "f", "arguments": "{}"}}],
                    }
                ]
            },
            "messages[0].tool_calls",
            "assistant",
        ),
    ],
)
def test_refusals_name_the_field(fields: dict[str, Any], param: str, words: str) -> None:
    with pytest.raises(WireError) as refused:
        chat_turn(decode_chat(body(**fields)), None)
    assert refused.value.status == 400 and refused.value.param == param
    assert words in refused.value.message


def test_bodies_that_are_not_json_are_a_400() -> None:
    with pytest.raises(WireError, match="not valid JSON"):
        decode_chat(b"{")


def test_completions_accept_text_or_ids_and_refuse_what_they_cannot_do() -> None:
    request = decode_completion(b'{"model": "m", "prompt": [1, 2], "stop": "x", "user": "u"}')
    upstream = upstream_completion(request, "m")
    assert upstream.prompt == [1, 2] and upstream.stop == ["x"]
    for field, value in (("echo", True), ("logprobs", 2), ("suffix", "x"), ("n", 2)):
        with pytest.raises(WireError) as refused:
            decode_completion(json.dumps({"model": "m", "prompt": "p", field: value}).encode())
        assert refused.value.param == field


def test_a_reply_streams_as_role_content_tool_call_head_and_arguments_finish_and_usage() -> None:
    call = ToolCall("c9", FunctionCall("calculator", '{"expression": "1+1"}'))
    reply = ChatReply("s", "Sure.", [call], "tool_calls", 10, 5, "e", 0)
    chunks = chat_chunks(reply, Head("id", 1, "m"), include_usage=True)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant" and deltas[1].content == "Sure."
    head, arguments = deltas[2].tool_calls, deltas[3].tool_calls
    assert head is not None and arguments is not None
    assert (head[0].id, head[0].type, head[0].function and head[0].function.name) == (
        "c9",
        "function",
        "calculator",
    )
    assert arguments[0].function is not None
    assert arguments[0].function.arguments == '{"expression": "1+1"}'
    assert chunks[-2].choices[0].finish_reason == "tool_calls"
    assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens == 15
