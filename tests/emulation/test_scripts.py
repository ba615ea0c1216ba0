"""What the emulated model replies (the agent and echo scripts), and the ChatML it reads back."""

from __future__ import annotations

import enum
import json
import re

import pytest
from pydantic import BaseModel

from libra.emulation import AgentScript, parse_chatml, render_chat, render_chat_text
from tests._helpers import CALCULATOR, LOOKUP, QUESTION, chat, complete, conversation, emulator

pytestmark = pytest.mark.anyio


async def test_replies_are_deterministic_for_a_seed() -> None:
    agent = AgentScript(think_tokens=(0, 40), garbage_rate=0.3)
    body = {"tools": [CALCULATOR, LOOKUP], "logprobs": True, "return_token_ids": True}
    runs = []
    for seed in (7, 7, 8):
        async with emulator(seed=seed, agent=agent) as client:
            runs.append(
                [await chat(client, **body, seed=request_seed) for request_seed in range(6)]
            )
    same = [[c.choices[0] for c in run] for run in runs]
    assert same[0] == same[1]
    assert same[0] != same[2]


async def test_agent_calls_calculator_with_numbers_from_the_question() -> None:
    async with emulator(agent=AgentScript(tool_call_probability=1.0)) as client:
        completion = await chat(client, tools=[CALCULATOR])
    (call,) = completion.choices[0].message.tool_calls or []
    expression = json.loads(call.function.arguments)["expression"]
    assert re.fullmatch(r"12 [-+*] 7 [-+*] 3", expression), expression


async def test_agent_fills_arguments_from_the_schema() -> None:
    async with emulator(agent=AgentScript(tool_call_probability=1.0)) as client:
        for request_seed in range(10):
            completion = await chat(client, tools=[LOOKUP], seed=request_seed)
            (call,) = completion.choices[0].message.tool_calls or []
            arguments = json.loads(call.function.arguments)
            assert isinstance(arguments["id"], int) and 1 <= arguments["id"] <= 1000
            assert isinstance(arguments["scale"], float | int)
            assert isinstance(arguments["verbose"], bool)
            assert arguments["unit"] in ("m", "km")


async def test_agent_answers_with_the_latest_tool_result() -> None:
    messages = [
        *QUESTION,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "calculator", "arguments": '{"expression": "12 * 7 + 3"}'}}
        ]},
        {"role": "tool", "content": "87", "tool_call_id": "c1"},
    ]  # fmt: skip
    agent = AgentScript(tool_call_probability=1.0, max_tool_turns=1)
    async with emulator(agent=agent) as client:
        completion = await chat(client, messages=messages, tools=[CALCULATOR])
    assert completion.choices[0].message.content == "The answer is 87."
    assert completion.choices[0].finish_reason == "stop"


async def test_agent_finds_tools_in_a_token_prompt() -> None:
    prompt = render_chat(QUESTION, [CALCULATOR], add_generation_prompt=True)
    async with emulator(agent=AgentScript(tool_call_probability=1.0)) as client:
        completion = await complete(client, prompt=prompt)
    assert completion.choices[0].text.startswith('<tool_call>\n{"name": "calculator"')


async def test_agent_garbage_is_never_a_valid_call() -> None:
    agent = AgentScript(garbage_rate=1.0)
    async with emulator(agent=agent) as client:
        for request_seed in range(40):
            completion = await chat(client, tools=[LOOKUP], seed=request_seed)
            (choice,) = completion.choices
            for call in choice.message.tool_calls or []:
                arguments = json.loads(call.function.arguments)
                valid = call.function.name == "lookup" and isinstance(arguments.get("id"), int)
                assert not valid, call


async def test_agent_think_tokens_pad_the_reply() -> None:
    agent = AgentScript(think_tokens=(50, 50), tool_call_probability=0.0)
    async with emulator(agent=agent) as client:
        completion = await chat(client, return_token_ids=True)
    (choice,) = completion.choices
    text = choice.message.content or ""
    thinking, answer = text.rsplit("\n", 1)
    assert len(thinking) + 1 == 50 and answer == "The answer is 3."


async def test_echo_script_repeats_the_last_user_message() -> None:
    async with emulator(script="echo") as client:
        completion = await chat(client)
    assert completion.choices[0].message.content == QUESTION[0]["content"]


def test_parse_chatml_recovers_messages_and_tools() -> None:
    text = render_chat_text(conversation(), [CALCULATOR], add_generation_prompt=True)
    messages, tools = parse_chatml(text)
    assert tools == [CALCULATOR]
    assert [m.role for m in messages] == [m.role for m in conversation()]
    assert messages[0].content == "You are careful."
    assert messages[3].content == "42"


class Colour(enum.Enum):
    RED = "red"
    BLUE = "blue"


class Point(BaseModel):
    x: int
    y: int | None = None


class PaintArguments(BaseModel):
    colour: Colour
    size: int | None
    at: Point
    label: str | None = None


async def test_agent_fills_refs_optionals_enums_and_nested_models_validly() -> None:
    schema = PaintArguments.model_json_schema()
    assert "$defs" in schema  # the enum and the nested model are references
    paint = {"type": "function", "function": {"name": "paint", "parameters": schema}}
    async with emulator(agent=AgentScript(tool_call_probability=1.0)) as client:
        for request_seed in range(20):
            completion = await chat(client, tools=[paint], seed=request_seed)
            (call,) = completion.choices[0].message.tool_calls or []
            arguments = PaintArguments.model_validate_json(call.function.arguments)
            assert isinstance(arguments.at, Point)


async def test_samples_of_one_prompt_differ_without_a_seed() -> None:
    agent = AgentScript(think_tokens=(0, 40))
    async with emulator(agent=agent) as client:
        seedless = [(await chat(client, tools=[CALCULATOR])).choices[0] for _ in range(8)]
        seeded = [(await chat(client, tools=[CALCULATOR], seed=3)).choices[0] for _ in range(3)]
    assert len({choice.message.content for choice in seedless}) > 1
    assert seeded[0] == seeded[1] == seeded[2]
