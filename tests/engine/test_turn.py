"""One model turn over a conversation that is not a trajectory (what a gateway session
is): the engine's turn mechanics need only the ``Dialogue`` protocol."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from libra.engine import (
    ContextFull,
    Dialogue,
    EngineConfig,
    SamplingConfig,
    Timings,
    TokenLog,
    generate_turn,
)
from libra.fleet import Endpoint
from libra.openai import Message
from tests._helpers import emulated_engine, tokenizer

pytestmark = pytest.mark.anyio


@dataclass
class Chat:
    """The smallest Dialogue: a chat with no env, no tools and no record."""

    messages: list[Message]
    key: str = "chat-1"
    prompt_key: str = "chat"
    turns: int = 0
    tokens: TokenLog = field(default_factory=TokenLog)
    tools: list[dict[str, Any]] = field(default_factory=list)
    pending: list[Message] = field(default_factory=list)
    last_endpoint: Endpoint | None = None
    weight_version: int | None = None
    weights_changed_turns: int = 0
    output_tokens: int = 0
    stop_strings: list[str] | None = None
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    timings: Timings = field(default_factory=Timings)

    @property
    def env_name(self) -> str:
        return "chat"

    def describe_tools_in_system_message(self) -> None:
        raise AssertionError("a chat without tools has none to describe")


async def test_a_turn_of_a_plain_chat_is_sampled_exactly() -> None:
    chat = Chat([Message(role="user", content="Hi")])
    dialogue: Dialogue = chat
    async with emulated_engine(["Hello there."]) as (engine, _):
        turn = await generate_turn(dialogue, engine)
    assert turn.generation.text == "Hello there." and len(turn.pieces) == 1
    assert turn.token_ids == [*tokenizer.encode("Hello there."), 258]
    assert tokenizer.decode(chat.tokens.ids).endswith("assistant\n")  # the prompt, rendered
    prompt = len(chat.tokens)
    turn.add_to(chat.tokens)
    assert chat.tokens.mask == [0] * prompt + [1] * len(turn.token_ids)
    assert chat.weight_version == 0 and chat.last_endpoint is not None


async def test_a_full_context_raises_and_releases_its_route() -> None:
    chat = Chat([Message(role="user", content="Tell me everything you know.")])
    async with emulated_engine(config=EngineConfig(max_context_tokens=8)) as (engine, _):
        with pytest.raises(ContextFull):
            await generate_turn(chat, engine)
        assert not any(engine.scheduler.calls_in_flight().values())
