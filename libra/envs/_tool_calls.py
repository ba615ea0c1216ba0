"""Reading tool calls out of what the model wrote.

Two sources: OpenAI ``tool_calls`` in a chat completion (a server-side parser already
split them out), and a text protocol for models that write calls inline. The text
protocol is pluggable per env (``Env.tool_call_parser``); the default reads Hermes /
Qwen style ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks.

A call that cannot be read is kept as a :class:`ToolCall` with an ``error``: the engine
returns that error to the model as the tool's result instead of failing the trajectory.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Protocol

from libra import openai


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One call the model made; ``error`` is set when it could not be parsed."""

    id: str
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


class ToolCallParser(Protocol):
    def parse(self, text: str) -> list[ToolCall]:
        """Every tool call written in ``text``, malformed ones included (with ``error``)."""
        ...

    def describe(self, tools: list[dict[str, Any]]) -> str:
        """Instructions that show a model the tools and how to call them, for servers
        whose chat template does not render tools itself."""
        ...


class HermesToolCallParser:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Hermes, Qwen)."""

    _BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
    example = '<tool_call>{"name": "NAME", "arguments": {"ARG": VALUE}}</tool_call>'

    def describe(self, tools: list[dict[str, Any]]) -> str:
        # The wording of Qwen2.5's and Hermes' chat templates, which models know.
        listing = "\n".join(json.dumps(tool) for tool in tools)
        return (
            "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{listing}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments "
            "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
        )

    def parse(self, text: str) -> list[ToolCall]:
        calls = []
        for index, match in enumerate(self._BLOCK.finditer(text)):
            calls.append(decode_call(f"call_{index}", match.group(1).strip(), self.example))
        return calls


def decode_call(call_id: str, document: str, example: str) -> ToolCall:
    """Decode one ``{"name": ..., "arguments": ...}`` JSON document written by the model."""
    try:
        payload = json.loads(document)
    except json.JSONDecodeError as exc:
        return ToolCall(
            call_id,
            "",
            error=f"the tool call is not valid JSON ({exc.msg}). Write calls as {example}",
        )
    except (RecursionError, ValueError) as exc:
        return ToolCall(call_id, "", error=f"the tool call cannot be read: {_unreadable(exc)}")
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
        return ToolCall(call_id, "", error=f'the tool call has no "name". Write calls as {example}')
    return with_arguments(call_id, payload["name"], payload.get("arguments", {}))


def with_arguments(call_id: str, name: str, arguments: object) -> ToolCall:
    """A call whose arguments may still be a JSON string (as OpenAI sends them)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as exc:
            return ToolCall(call_id, name, error=f"the arguments are not valid JSON ({exc.msg})")
        except (RecursionError, ValueError) as exc:
            return ToolCall(
                call_id, name, error=f"the arguments cannot be read: {_unreadable(exc)}"
            )
    if not isinstance(arguments, dict):
        return ToolCall(call_id, name, error="the arguments must be a JSON object")
    return ToolCall(call_id, name, arguments)


def _unreadable(exc: RecursionError | ValueError) -> str:
    """Why valid-looking JSON could not be decoded: Python's own limits, which a model's
    garbage can reach (nesting past the recursion limit, an integer of thousands of
    digits); the model's doing, so it reads why instead of the trajectory failing."""
    if isinstance(exc, RecursionError):
        return "it is nested too deeply"
    return str(exc).split(";")[0]


def from_openai(calls: list[openai.ToolCall]) -> list[ToolCall]:
    """Calls already split out by the server (``message.tool_calls``)."""
    return [with_arguments(c.id, c.function.name, c.function.arguments) for c in calls]
