"""Scripted model behaviour: what the emulated model says, given the conversation.

A :class:`Script` is any callable from a :class:`Conversation` to a :class:`Reply`. The
server builds the conversation from the request (chat messages, or a ChatML token prompt
parsed back into messages and tools), with a ``random.Random`` seeded from the server
seed, the request's seed (drawn per request when it has none) and the prompt's token
ids: a seeded request always gets the same reply, seedless samples of a prompt differ.

Built-ins: :class:`AgentScript` (``"agent"``) acts like a small tool-using model, with
optional malformed output for robustness tests; :class:`EchoScript` (``"echo"``) repeats
the last user message; :class:`ScriptedReplies` replays fixed texts turn by turn.
"""

from __future__ import annotations

import json
import random
import re
import string
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Literal, Protocol

from pydantic import Field, model_validator

from libra.config import Section
from libra.emulation._tokenizer import ByteTokenizer
from libra.openai import Message

_CHATML_BLOCK = re.compile(r"<\|im_start\|>(system|user|assistant|tool)\n(.*?)<\|im_end\|>", re.S)
_TOOLS_BLOCK = re.compile(r"\n\n# Tools\n.*?<tools>\n(.*?)\n</tools>.*", re.S)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_WORD = re.compile(r"[A-Za-z][A-Za-z0-9_'-]*")
_MAX_DEPTH = 8  # nesting of schemas followed (a recursive model ends there)
_EXPRESSION_WORDS = ("expression", "expr", "formula", "equation")
_FILLER_WORDS = (
    "let", "me", "think", "about", "this", "step", "by", "the", "question", "asks", "for",
    "a", "value", "so", "first", "check", "what", "we", "know", "then", "use", "tool",
    "result", "carefully", "and", "verify", "it", "is", "consistent", "with", "given",
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class Reply:
    """What the model says; ``garbage`` marks deliberately malformed output."""

    text: str
    garbage: bool = False


class Conversation:
    """What a script sees of one generation request.

    ``messages`` are the request's chat messages, or those parsed back from a ChatML
    token prompt (empty for a prompt that is not ChatML); ``tools`` are the request's
    tools or those listed in the prompt's ``<tools>`` block; ``turn`` is the number of
    assistant turns so far; ``rng`` is seeded from the server seed, the request seed
    and the prompt ids.
    A token prompt is parsed only if a script asks for its messages or tools. A prompt
    that ends inside an assistant turn (one a pause cut short) is shown up to that turn's
    start: the script writes the whole turn, and the server sends what is still missing.
    """

    def __init__(
        self,
        prompt_token_ids: list[int],
        messages: list[Message] | None,
        tools: list[dict[str, Any]] | None,
        rng: random.Random,
        tokenizer: ByteTokenizer,
    ) -> None:
        self.prompt_token_ids = prompt_token_ids
        self.rng = rng
        self._tokenizer = tokenizer
        if messages is not None:  # else parsed from the prompt on first use
            self.__dict__["messages"] = messages
        if tools is not None:
            self.__dict__["tools"] = tools

    @cached_property
    def messages(self) -> list[Message]:
        return self._parsed[0]

    @cached_property
    def tools(self) -> list[dict[str, Any]]:
        return self._parsed[1]

    @cached_property
    def _parsed(self) -> tuple[list[Message], list[dict[str, Any]]]:
        return parse_chatml(self.prompt_text)

    @cached_property
    def prompt_text(self) -> str:
        """The decoded prompt, special tokens included."""
        return self._tokenizer.decode(self.prompt_token_ids)

    @cached_property
    def turn(self) -> int:
        """Assistant turns so far (0 on the first generation)."""
        return sum(1 for message in self.messages if message.role == "assistant")

    def last_content(self, *roles: str) -> str | None:
        """Content of the latest message with one of ``roles``, or None if there is none."""
        for message in reversed(self.messages):
            if message.role in roles:
                return message.content or ""
        return None

    @classmethod
    def from_prompt(
        cls,
        prompt_token_ids: list[int],
        rng: random.Random,
        tokenizer: ByteTokenizer,
        packed: bytes | None = None,
    ) -> Conversation:
        """A conversation recovered from a (ChatML) token prompt (``packed``: the ids
        already packed, see :meth:`ByteTokenizer.decode`)."""
        text = tokenizer.decode(prompt_token_ids, packed=packed)
        conversation = cls(prompt_token_ids, None, None, rng, tokenizer)
        conversation.__dict__["prompt_text"] = text  # already decoded: seed the cache
        return conversation


class Script(Protocol):
    """The model's behaviour: a reply for a conversation (must be deterministic in ``rng``)."""

    def __call__(self, conversation: Conversation, /) -> Reply: ...


def parse_chatml(text: str) -> tuple[list[Message], list[dict[str, Any]]]:
    """Messages and tools of a ChatML text rendered by the emulator's template.

    Only complete ``<|im_start|>…<|im_end|>`` blocks count; a trailing open block (the
    generation prompt) is not a message. Assistant tool calls stay in the content text.
    """
    messages: list[Message] = []
    tools: list[dict[str, Any]] = []
    for index, match in enumerate(_CHATML_BLOCK.finditer(text)):
        role, content = match.group(1), match.group(2)
        if index == 0 and role == "system":
            tools_match = _TOOLS_BLOCK.search(content)
            if tools_match is not None:
                tools = _parse_tool_lines(tools_match.group(1))
                content = content[: tools_match.start()]
        messages.append(Message(role=role, content=content))  # type: ignore[arg-type]
    return messages, tools


def _parse_tool_lines(block: str) -> list[dict[str, Any]]:
    tools: list[dict[str, Any]] = []
    for line in block.splitlines():
        try:
            tool = json.loads(line)
        except json.JSONDecodeError:
            continue  # a damaged line in a hand-written prompt: skip that tool
        if isinstance(tool, dict):
            tools.append(tool)
    return tools


# -------------------------------------------------------------------------- built-ins


class EchoScript:
    """Replies with the last user message (the whole prompt if there is none)."""

    def __call__(self, conversation: Conversation, /) -> Reply:
        last_user = conversation.last_content("user")
        return Reply(conversation.prompt_text if last_user is None else last_user)


class ScriptedReplies:
    """Replays ``texts[i]`` on turn ``i``; tests use it to force exact behaviour."""

    def __init__(self, texts: Sequence[str]) -> None:
        self.texts = list(texts)

    def __call__(self, conversation: Conversation, /) -> Reply:
        turn = conversation.turn
        if turn >= len(self.texts):
            raise IndexError(
                f"ScriptedReplies has {len(self.texts)} replies; asked for turn {turn}"
            )
        return Reply(self.texts[turn])


GarbageKind = Literal["malformed_json", "unknown_tool", "wrong_types", "gibberish"]


class AgentScript(Section):
    """A small tool-using model.

    On turn ``t`` it calls one of the offered tools with probability
    ``tool_call_probability * tool_call_decay**t`` (never from turn ``max_tool_turns``
    on), writing a Hermes ``<tool_call>`` block whose arguments follow the tool's JSON
    schema, filled from numbers and words of the last user or tool message. Otherwise it
    answers ``"The answer is N."`` with N taken from the latest tool result, else the
    last user message. With probability ``garbage_rate`` a reply is malformed instead:
    broken JSON, an unknown tool, wrongly typed arguments, or gibberish. ``think_tokens``
    prepends that many tokens (drawn from the range) of filler reasoning.
    """

    tool_call_probability: float = Field(
        default=0.9, ge=0, le=1, description="Probability of a tool call on the first turn."
    )
    tool_call_decay: float = Field(
        default=0.6, ge=0, le=1, description="Factor on that probability per turn."
    )
    max_tool_turns: int = Field(default=6, ge=0, description="No tool calls from this turn on.")
    garbage_rate: float = Field(
        default=0.0, ge=0, le=1, description="Probability that a reply is malformed."
    )
    think_tokens: tuple[int, int] = Field(
        default=(0, 0), description="Range (inclusive) of filler tokens before the action."
    )

    @model_validator(mode="after")
    def _check_think_range(self) -> AgentScript:
        low, high = self.think_tokens
        if not 0 <= low <= high:
            raise ValueError("think_tokens must be a range (low, high) with 0 <= low <= high")
        return self

    def __call__(self, conversation: Conversation, /) -> Reply:
        rng = conversation.rng
        functions = _functions(conversation.tools)
        thinking = _filler(rng, rng.randint(*self.think_tokens))
        if rng.random() < self.garbage_rate:
            return Reply(thinking + _garbage(conversation, functions), garbage=True)
        if functions and self._calls_tool(conversation.turn, rng):
            function = rng.choice(functions)
            arguments = _arguments(function, conversation)
            return Reply(thinking + _tool_call_text(function["name"], arguments))
        return Reply(thinking + f"The answer is {_answer_number(conversation)}.")

    def _calls_tool(self, turn: int, rng: random.Random) -> bool:
        if turn >= self.max_tool_turns:
            return False
        return rng.random() < self.tool_call_probability * self.tool_call_decay**turn


def builtin_script(name: Literal["agent", "echo"], agent: AgentScript | None = None) -> Script:
    """The built-in script called ``name`` (``agent`` uses the given settings)."""
    if name == "agent":
        return agent if agent is not None else AgentScript()
    if name == "echo":
        return EchoScript()
    raise ValueError(f"unknown script {name!r}; built-ins are 'agent' and 'echo'")


# ------------------------------------------------------------------ agent's helpers


def _functions(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ``function`` parts of OpenAI tools that have a name."""
    functions = []
    for tool in tools:
        function = tool.get("function", tool)  # tolerate a bare function schema
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            functions.append(function)
    return functions


def _tool_call_text(name: str, arguments: Any) -> str:
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


def _source_text(conversation: Conversation) -> str:
    """The message the model reacts to: the last user or tool message."""
    text = conversation.last_content("user", "tool")
    return conversation.prompt_text if text is None else text


def _numbers(text: str) -> list[float]:
    return [float(match) for match in _NUMBER.findall(text)]


def _format_number(value: float) -> str:
    return str(int(value)) if value == int(value) else repr(value)


def _answer_number(conversation: Conversation) -> str:
    for source in (conversation.last_content("tool"), conversation.last_content("user")):
        numbers = _numbers(source or "")
        if numbers:
            return _format_number(numbers[-1])
    return str(conversation.rng.randint(0, 100))


def _arguments(function: dict[str, Any], conversation: Conversation) -> dict[str, Any]:
    """Arguments for ``function`` following its JSON schema (required ones always)."""
    parameters = function.get("parameters") or {}
    filler = _Filler(_source_text(conversation), conversation.rng, parameters.get("$defs") or {})
    return filler.object(parameters)


@dataclass(frozen=True, slots=True)
class _Filler:
    """Fills values valid for a JSON schema: ``$ref`` to ``$defs`` resolved, ``anyOf`` /
    ``oneOf`` (an optional is ``anyOf [X, null]``) filled with one non-null option."""

    source: str
    rng: random.Random
    defs: dict[str, Any]

    def object(self, schema: dict[str, Any], depth: int = 0) -> dict[str, Any]:
        """Required properties always, optional ones half the time."""
        properties: dict[str, Any] = schema.get("properties") or {}
        required = set(schema.get("required") or ())
        return {
            key: self.value(key, sub if isinstance(sub, dict) else {}, depth + 1)
            for key, sub in properties.items()
            if key in required or self.rng.random() < 0.5
        }

    def value(self, name: str, schema: dict[str, Any], depth: int = 0) -> Any:
        schema = self.resolve(schema)
        if "const" in schema:
            return schema["const"]
        kind = schema.get("type", "string")
        if kind == "object" and depth < _MAX_DEPTH:
            return self.object(schema, depth)
        if kind == "array" and depth < _MAX_DEPTH:
            items = schema.get("items")
            items = items if isinstance(items, dict) else {}
            least = max(1, int(schema.get("minItems", 1)))
            count = self.rng.randint(least, max(least, 3))
            return [self.value(name, items, depth + 1) for _ in range(count)]
        return _value(name, schema, self.source, self.rng)

    def resolve(self, schema: dict[str, Any]) -> dict[str, Any]:
        """The schema with references followed and one union option chosen."""
        for _ in range(_MAX_DEPTH):
            reference = schema.get("$ref")
            options = schema.get("anyOf") or schema.get("oneOf") or schema.get("allOf")
            if isinstance(reference, str):
                target = self.defs.get(reference.rsplit("/", 1)[-1])
                schema = target if isinstance(target, dict) else {}
            elif isinstance(options, list) and options:
                concrete = [o for o in options if isinstance(o, dict) and not _is_null(o)]
                schema = self.rng.choice(concrete) if concrete else {"const": None}
            else:
                return schema
        return schema


def _is_null(schema: dict[str, Any]) -> bool:
    return schema.get("type") == "null" or ("const" in schema and schema["const"] is None)


def _value(name: str, schema: dict[str, Any], source: str, rng: random.Random) -> Any:
    """A value of the schema's type, drawn from ``source`` where that makes sense."""
    if schema.get("enum"):
        return rng.choice(schema["enum"])
    kind = schema.get("type", "string")
    if isinstance(kind, list):  # e.g. ["integer", "null"]
        kind = next((option for option in kind if option != "null"), "string")
    if kind == "integer":
        return _integer(schema, source, rng)
    if kind == "number":
        return _number(schema, source, rng)
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "array":
        items = schema.get("items")
        items = items if isinstance(items, dict) else {}
        return [_value(name, items, source, rng) for _ in range(rng.randint(1, 3))]
    if kind == "object":
        properties = schema.get("properties") or {}
        return {key: _value(key, sub, source, rng) for key, sub in properties.items()}
    return _string(name, schema, source, rng)


def _bounds(schema: dict[str, Any]) -> tuple[float, float]:
    low = float(schema.get("minimum", 0))
    high = float(schema.get("maximum", low + 100))
    return low, max(low, high)


def _integer(schema: dict[str, Any], source: str, rng: random.Random) -> int:
    low, high = _bounds(schema)
    candidates = [int(n) for n in _numbers(source) if n == int(n) and low <= n <= high]
    if candidates:
        return rng.choice(candidates)
    return rng.randint(int(low), int(high))


def _number(schema: dict[str, Any], source: str, rng: random.Random) -> float:
    low, high = _bounds(schema)
    candidates = [n for n in _numbers(source) if low <= n <= high]
    if candidates:
        return rng.choice(candidates)
    return round(rng.uniform(low, high), 2)


def _string(name: str, schema: dict[str, Any], source: str, rng: random.Random) -> str:
    description = str(schema.get("description", "")).lower()
    lowered = name.lower()
    if lowered in _EXPRESSION_WORDS or "expression" in description or "arithmetic" in description:
        return _expression(source, rng)
    if "code" in lowered:
        return f"print({_expression(source, rng)})"
    words = _WORD.findall(source)
    if not words:
        return "".join(rng.choices(string.ascii_lowercase, k=6))
    start = rng.randrange(len(words))
    return " ".join(words[start : start + rng.randint(1, 4)])


def _expression(source: str, rng: random.Random) -> str:
    """An arithmetic expression over the numbers of ``source`` (made up if too few)."""
    numbers = [_format_number(n) for n in _numbers(source)]
    while len(numbers) < 2:
        numbers.append(str(rng.randint(1, 99)))
    expression = numbers[0]
    for number in numbers[1:]:
        expression += f" {rng.choice('+-*')} {number}"
    return expression


def _filler(rng: random.Random, tokens: int) -> str:
    """Exactly ``tokens`` tokens of ASCII filler reasoning, ending in a newline."""
    if tokens <= 0:
        return ""
    words: list[str] = []
    length = 0
    while length < tokens:
        word = rng.choice(_FILLER_WORDS)
        words.append(word)
        length += len(word) + 1
    return " ".join(words)[: tokens - 1] + "\n"


# ------------------------------------------------------------------------- garbage


def _garbage(conversation: Conversation, functions: list[dict[str, Any]]) -> str:
    rng = conversation.rng
    kinds: list[GarbageKind] = ["gibberish"]
    if functions:
        kinds += ["malformed_json", "unknown_tool", "wrong_types"]
    kind = rng.choice(kinds)
    if kind == "gibberish":
        return _gibberish(rng)
    function = rng.choice(functions)
    if kind == "unknown_tool":
        name = function["name"] + "_" + "".join(rng.choices(string.ascii_lowercase, k=4))
        return _tool_call_text(name, _arguments(function, conversation))
    if kind == "wrong_types":
        return _tool_call_text(function["name"], _wrong_arguments(function, rng))
    body = json.dumps({"name": function["name"], "arguments": _arguments(function, conversation)})
    cut = rng.randint(1, len(body) - 1)  # any proper prefix of a JSON object is invalid
    return f"<tool_call>\n{body[:cut]}\n</tool_call>"


def _wrong_arguments(function: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    """Every declared argument with a value of the wrong JSON type."""
    properties = (function.get("parameters") or {}).get("properties") or {}
    if not properties:
        return {"unexpected": [rng.randint(0, 9)]}
    wrong: dict[str, Any] = {}
    for name, schema in properties.items():
        kind = schema.get("type") if isinstance(schema, dict) else None
        if kind in ("integer", "number", "boolean"):
            wrong[name] = "".join(rng.choices(string.ascii_lowercase, k=5))
        elif kind in ("array", "object"):
            wrong[name] = rng.randint(0, 9)
        else:
            wrong[name] = {"value": rng.randint(0, 9)}
    return wrong


def _gibberish(rng: random.Random) -> str:
    words = (
        "".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 9)))
        for _ in range(rng.randint(5, 20))
    )
    return " ".join(words)
