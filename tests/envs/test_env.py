"""The Env API: tools from type hints, argument checks, registry."""

from __future__ import annotations

from typing import Literal

import pydantic
import pytest

from libra.envs import Env, UnknownEnvError, available_envs, load_env, tool


class Shop(Env):
    def reset(self, seed: int) -> str:
        return "buy something"

    @tool
    def buy(self, item: Literal["apple", "pear"], count: int = 1, note: str | None = None) -> str:
        """Buy fruit.

        Longer explanation that is not part of the description.

        Args:
            item: what to buy
            count: how many,
                at least one
        Returns:
            a receipt
        """
        return f"{count} {item}"

    def helper(self) -> None:
        """Not a tool."""

    def reward(self, answer: str) -> float:
        return 0.0


def test_schema_comes_from_hints_and_docstring() -> None:
    [schema] = Shop.tool_schemas()
    function = schema["function"]
    assert schema["type"] == "function"
    assert function["name"] == "buy"
    assert function["description"] == "Buy fruit."
    parameters = function["parameters"]
    assert parameters["required"] == ["item"]
    assert parameters["additionalProperties"] is False
    assert parameters["properties"]["item"] == {
        "description": "what to buy",
        "enum": ["apple", "pear"],
        "type": "string",
    }
    assert parameters["properties"]["count"]["description"] == "how many, at least one"
    assert parameters["properties"]["count"]["default"] == 1


def test_arguments_are_validated() -> None:
    spec = Shop.tool_specs()["buy"]
    assert spec.validate({"item": "pear", "count": "2"}) == {
        "item": "pear",
        "count": 2,
        "note": None,
    }
    with pytest.raises(pydantic.ValidationError):
        spec.validate({"item": "plum"})
    with pytest.raises(pydantic.ValidationError):
        spec.validate({"item": "apple", "colour": "red"})


def test_subclass_inherits_and_overrides_tools() -> None:
    class BigShop(Shop):
        @tool
        def sell(self, item: str) -> str:
            """Sell something."""
            return item

    assert set(BigShop.tool_specs()) == {"buy", "sell"}
    assert set(Shop.tool_specs()) == {"buy"}


def test_untyped_tool_parameters_are_refused() -> None:
    with pytest.raises(TypeError, match="needs a type hint"):

        class Bad(Env):
            def reset(self, seed: int) -> str:
                return ""

            @tool
            def act(self, thing) -> str:  # type: ignore[no-untyped-def]
                return ""

            def reward(self, answer: str) -> float:
                return 0.0


def test_an_env_must_define_reset_and_reward() -> None:
    class Incomplete(Env):
        pass

    with pytest.raises(TypeError, match="abstract"):
        Incomplete()  # type: ignore[abstract]


def test_sandbox_needs_a_spec() -> None:
    with pytest.raises(RuntimeError, match="declares no sandbox_spec"):
        _ = Shop().sandbox


def test_envs_are_found_by_entry_point_and_path() -> None:
    assert {"calc", "guess"} <= set(available_envs())
    assert load_env("calc").__name__ == "Calc"
    assert load_env("tests.envs.test_env:Shop") is Shop
    with pytest.raises(UnknownEnvError, match=r"unknown env 'nope' \(available: .*calc"):
        load_env("nope")
    with pytest.raises(UnknownEnvError, match="not an Env subclass"):
        load_env("tests.envs.test_env:test_schema_comes_from_hints_and_docstring")
