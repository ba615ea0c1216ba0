"""``@tool`` methods: a parameter the model cannot be shown is refused at class creation."""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

import pytest

from libra.envs import Env, tool


def env_with_parameter(hint: Any) -> type[Env]:
    class Tooled(Env):
        def reset(self, seed: int) -> str:
            return ""

        def act(self, thing: Any) -> str:
            return ""

        def reward(self, answer: str) -> float:
            return 0.0

    Tooled.act.__annotations__["thing"] = hint
    tool(Tooled.act)
    return type("Subclass", (Tooled,), {})  # the tools are read when a class is made


@pytest.mark.parametrize(
    ("hint", "shown"),
    [(socket.socket, "socket.socket"), (Callable[[int], int], "collections.abc.Callable")],
)
def test_a_parameter_without_json_schema_names_the_tool_and_the_types_that_work(
    hint: Any, shown: str
) -> None:
    with pytest.raises(TypeError) as raised:
        env_with_parameter(hint)
    message = str(raised.value)
    assert message.startswith(f"tool act: parameter 'thing' has type {shown}")
    assert "no JSON schema" in message and "use str, int, float, bool" in message


def test_parameters_with_a_schema_are_accepted() -> None:
    env = env_with_parameter(list[dict[str, int]] | None)
    assert env.tool_schemas()[0]["function"]["parameters"]["required"] == ["thing"]
