"""The gateway's core against the emulated server: sessions found by prefix and by key,
tool results turned into scheduler signals, edited history, idle expiry, recording,
failures, pause and weight reloads."""

from __future__ import annotations

import json

import pytest

from libra.gateway import ChatReply, ChatTurn, GatewayCore, Sessions
from libra.openai import Message
from tests._helpers import (
    CALCULATOR,
    PathRecorder,
    assert_tokens_consistent,
    emulated_engine,
    sampled_spans,
    tokenizer,
)

pytestmark = pytest.mark.anyio


def call(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


QUESTION = [
    Message(role="system", content="You are careful."),
    Message(role="user", content="What is 6 times 7?"),
]
REPLIES = ["Let me compute. " + call("calculator", '{"expression": "6 * 7"}'), "It is 42."]


def echoed(reply: ChatReply) -> Message:
    """The reply as an OpenAI client sends it back in its next request."""
    return Message(role="assistant", content=reply.content, tool_calls=reply.tool_calls or None)


def tool_result(reply: ChatReply, content: str) -> Message:
    return Message(role="tool", content=content, tool_call_id=reply.tool_calls[0].id)


async def agent(core: GatewayCore, key: str | None = None) -> list[ChatReply]:
    """A two-turn agent: asks, runs the tool it is told to, asks again."""
    first = await core.chat(ChatTurn(list(QUESTION), tools=[CALCULATOR], session=key))
    history = [*QUESTION, echoed(first), tool_result(first, "42")]
    second = await core.chat(ChatTurn(history, tools=[CALCULATOR], session=key))
    return [first, second]


@pytest.mark.parametrize("key", [None, "agent-7"])
async def test_a_tool_using_agent_is_one_session_by_prefix_or_by_key(key: str | None) -> None:
    scheduler = PathRecorder()
    async with (
        emulated_engine(REPLIES, scheduler=scheduler) as (engine, records),
        Sessions(engine) as core,
    ):
        first, second = await agent(core, key)
        assert first.session == second.session == (key or first.session)
        assert first.finish_reason == "tool_calls" and first.content == "Let me compute."
        assert [c.function.name for c in first.tool_calls] == ["calculator"]
        assert json.loads(first.tool_calls[0].function.arguments) == {"expression": "6 * 7"}
        assert (second.finish_reason, second.content) == ("stop", "It is 42.")
        assert second.tool_calls == []
        assert len(core) == 1
        await core.report(second.session, reward=1.0, done=True)
        assert len(core) == 0
    [record] = records
    assert (record.status, record.stop_reason, record.reward, record.turns) == (
        "completed",
        "done",
        1.0,
        2,
    )
    assert [r.tool for r in record.tool_returns] == ["calculator"]
    assert record.tokens == "exact" and record.weight_versions
    assert_tokens_consistent(record, [CALCULATOR])
    assert sampled_spans(record) == [[*tokenizer.encode(r), 258] for r in REPLIES]
    # The scheduler was told of the tool result, and forgot the session at its end.
    assert scheduler.paths == {record.id: ["calculator:small:success"]}
