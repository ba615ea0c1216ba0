"""One model turn over a conversation that is not a trajectory (what a gateway session
is): the engine's turn mechanics need only the ``Dialogue`` protocol."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import anyio
import pytest

from libra.emulation import EmulatorConfig, LatencyModel, running_emulator
from libra.engine import (
    ContextFull,
    Dialogue,
    Engine,
    EngineConfig,
    SamplingConfig,
    ServerTrouble,
    ServerUnavailable,
    Timings,
    TokenLog,
    generate_turn,
    http_transport,
)
from libra.fleet import Endpoint
from libra.openai import Message
from libra.sched.policies import LeastLoadedScheduler
from tests._helpers import MODEL, emulated_engine, hung_server, tokenizer

pytestmark = pytest.mark.anyio


@dataclass
class Chat:
    """The smallest Dialogue: a chat with no env, no tools and no record."""

    messages: list[Message]
    key: str = "chat-1"
    event_id: str = "chat-1"
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


# A hung server's call times out quickly: this much, plus a little per token it may sample.
HUNG_CALL_S = 0.3
FAST = EngineConfig(call_timeout_per_token_s=0.0001, retry_backoff_s=0.0)


@pytest.mark.faults
async def test_a_call_to_a_hung_server_is_cancelled_and_retried_elsewhere_with_its_context() -> (
    None
):
    chat = Chat([Message(role="user", content="Hi")])
    emulated = EmulatorConfig(latency=LatencyModel.zero())
    with running_emulator(emulated) as healthy_url:
        async with hung_server() as hung_url, http_transport("httpx") as http:
            hung = Endpoint(hung_url, model=MODEL, name="hung", call_timeout_s=HUNG_CALL_S)
            healthy = Endpoint(healthy_url, model=MODEL, name="healthy")
            engine = Engine(http, LeastLoadedScheduler([hung, healthy]), config=FAST)
            trouble = ServerTrouble()
            started = anyio.current_time()
            turn = await generate_turn(chat, engine, trouble)
            waited = anyio.current_time() - started
            expected_prompt = await engine.renderer.prompt(healthy, chat.messages, [])
            router = engine.scheduler.router
            cooling = {i.name for i in router.instances if i.down_until > router.clock()}
            assert not any(engine.scheduler.calls_in_flight().values())
    assert HUNG_CALL_S <= waited < 10  # one short timeout, not the 600 s request cap
    assert [piece.endpoint.name for piece in turn.pieces] == ["healthy"]
    assert cooling == {"hung"}  # the hung instance sits out its cooldown
    assert trouble.unresolved is None  # a generation returned: the trouble is over
    # The same context, as exact tokens: the prompt the healthy server renders.
    assert chat.tokens.source == "exact" and chat.tokens.ids == expected_prompt
    assert turn.pieces[0].generation.path == "tokens" and turn.token_ids


@pytest.mark.faults
async def test_a_turn_whose_every_attempt_hangs_fails_with_the_reason() -> None:
    chat = Chat([Message(role="user", content="Hi")])
    config = FAST.model_copy(update={"max_attempts": 2, "call_timeout_s": HUNG_CALL_S})
    async with hung_server() as url, http_transport("httpx") as http:
        engine = Engine(http, LeastLoadedScheduler([Endpoint(url, model=MODEL)]), config=config)
        trouble = ServerTrouble()
        with pytest.raises(ServerUnavailable) as failure:
            await generate_turn(chat, engine, trouble)
        assert not any(engine.scheduler.calls_in_flight().values())
        assert engine.generations.in_flight == 0
    assert str(failure.value).startswith("2 failed attempts, the last: ")
    # 0.3 s, plus 0.0001 s for each of the 1024 tokens the turn may sample
    assert "no answer in 0.4 s (taken as hung)" in str(failure.value)
    assert trouble.unresolved == str(failure.value)


async def test_a_long_generation_has_time_in_proportion_to_its_token_budget() -> None:
    """A slow server that is sampling is not hung: the call's timeout grows with the
    tokens it may sample, so this one (about 0.5 s) finishes under a 0.1 s base."""
    chat = Chat(
        [Message(role="user", content="Hi")], sampling=SamplingConfig(max_tokens_per_turn=50)
    )
    slow = LatencyModel(
        prefill_s_per_token=0.0, step_base_s=0.01, step_per_seq_s=0.0, step_per_ctx_token_s=0.0
    )
    config = EngineConfig(call_timeout_s=0.1, call_timeout_per_token_s=0.02, max_attempts=1)
    async with emulated_engine(["x" * 48], config=config, latency=slow) as (engine, _):
        turn = await generate_turn(chat, engine)
    assert turn.generation.completion_tokens == 49  # 48 characters and the end of turn
