"""Tools as typed methods: the ``@tool`` decorator and the schema it derives.

A tool is an ordinary method of an :class:`~libra.envs.Env` subclass. Its type hints
become a pydantic model, which gives both the OpenAI function schema shown to the model
and the validation of the arguments the model writes. The docstring's first paragraph
is the tool's description; an ``Args:`` section (Google style) describes the parameters.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any, TypeVar, get_origin, get_type_hints

import pydantic

from libra.openai import tool_schema

F = TypeVar("F", bound=Callable[..., Any])

_TOOL_MARK = "__libra_tool__"
_SCHEMA_TYPES = (
    "str, int, float, bool, None, a Literal, an Enum, a list, tuple or dict of these, "
    "an Optional or union of them, a pydantic model, a dataclass or a TypedDict"
)
_ARGS_HEADER = re.compile(r"^\s*(Args|Arguments|Parameters):\s*$")
_ARG_LINE = re.compile(r"^\s+(\w+)(?:\s*\([^)]*\))?:\s*(.*)$")


class ToolError(Exception):
    """Raise from a tool to send the model an error it can act on (the message is shown)."""


class ToolTimeout(ToolError):
    """Raise from a tool that ran out of its own time budget (the message is shown).

    The scheduler sees the call as ``timeout``, as when the engine cuts a tool off at
    ``tool_timeout_s``, not as ``failure``.
    """

    @classmethod
    def after(cls, tool: str, timeout_s: float) -> ToolTimeout:
        """The engine's own: ``tool`` was cut off after ``timeout_s`` seconds."""
        return cls(f"{tool} timed out after {timeout_s:g} s")


def tool(fn: F) -> F:
    """Mark an env method as a tool the model may call."""
    setattr(fn, _TOOL_MARK, True)
    return fn


def is_tool(obj: object) -> bool:
    return callable(obj) and getattr(obj, _TOOL_MARK, False)


@dataclass(frozen=True)
class ToolSpec:
    """One tool: its name, its OpenAI schema and the model that validates its arguments."""

    name: str
    description: str
    arguments: type[pydantic.BaseModel]
    is_async: bool

    @cached_property
    def schema(self) -> dict[str, Any]:
        parameters = self.arguments.model_json_schema()
        parameters.pop("title", None)
        for prop in parameters.get("properties", {}).values():
            prop.pop("title", None)
        return tool_schema(self.name, self.description, parameters)

    def validate(self, arguments: object) -> dict[str, Any]:
        """Check the model's arguments; raises ``pydantic.ValidationError`` when they are wrong."""
        # The fields as validated (``extra="forbid"``: there are no others). ``dict(model)``
        # would first ask the model for ``keys``, through pydantic's slow ``__getattr__``.
        return dict(self.arguments.model_validate(arguments).__dict__)

    @classmethod
    def from_method(cls, fn: Callable[..., Any]) -> ToolSpec:
        description, arg_docs = _parse_docstring(inspect.getdoc(fn) or "")
        hints = get_type_hints(fn)
        fields: dict[str, Any] = {}
        for param in list(inspect.signature(fn).parameters.values())[1:]:  # skip self
            if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
                raise TypeError(f"tool {fn.__name__}: *args/**kwargs cannot be described")
            if param.name not in hints:
                raise TypeError(f"tool {fn.__name__}: parameter {param.name!r} needs a type hint")
            _check_schema(fn.__name__, param.name, hints[param.name])
            default = ... if param.default is param.empty else param.default
            field = pydantic.Field(default, description=arg_docs.get(param.name))
            fields[param.name] = (hints[param.name], field)
        model = pydantic.create_model(
            f"{fn.__name__}_arguments",
            __config__=pydantic.ConfigDict(extra="forbid"),
            **fields,
        )
        return cls(
            name=fn.__name__,
            description=description,
            arguments=model,
            is_async=inspect.iscoroutinefunction(fn),
        )


def _check_schema(tool_name: str, parameter: str, hint: Any) -> None:
    """Refuse, naming the tool and the parameter, a type the model cannot be shown: one
    with no JSON schema (a socket, a callable, an arbitrary class)."""
    try:
        pydantic.TypeAdapter(hint).json_schema()
    except (pydantic.PydanticSchemaGenerationError, pydantic.PydanticInvalidForJsonSchema):
        raise TypeError(
            f"tool {tool_name}: parameter {parameter!r} has type {_type_name(hint)}, which "
            f"has no JSON schema to show the model; use {_SCHEMA_TYPES}"
        ) from None


def _type_name(hint: Any) -> str:
    """``socket.socket``, ``collections.abc.Callable[[int], int]``: as the user wrote it."""
    if isinstance(hint, type) and get_origin(hint) is None:
        module = "" if hint.__module__ == "builtins" else f"{hint.__module__}."
        return f"{module}{hint.__qualname__}"
    return repr(hint)


def _parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """Split a docstring into its description and the per-argument lines of ``Args:``."""
    description: list[str] = []
    args: dict[str, str] = {}
    in_args = False
    current: str | None = None
    for line in doc.splitlines():
        if _ARGS_HEADER.match(line):
            in_args = True
            continue
        if not in_args:
            description.append(line)
            continue
        if match := _ARG_LINE.match(line):
            current = match.group(1)
            args[current] = match.group(2).strip()
        elif line.strip() and current is not None and line.startswith((" ", "\t")):
            args[current] += " " + line.strip()
        elif line.strip():
            in_args = False  # another section (Returns:, Raises:) starts
            current = None
    text = "\n".join(description).strip()
    return text.split("\n\n")[0].replace("\n", " "), args
