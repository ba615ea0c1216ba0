"""From tool returns to causal states: the keys of C-MLFQ's prefix tree.

By default a tool return's state is ``tool:size:status`` (e.g. ``run_tests:large:failure``),
the reference's reduction. Envs differ in which parts carry information: a file viewer's
output size says little about what is left, a test runner's status says a lot. A
:class:`SignalMap` holds rules per env (by the env's name, which every
``RouteRequest`` carries); the first rule that matches a
return decides: ``ignore`` it (the path does not grow), or ``keep`` it under a state
name built from a template such as ``"{tool}:{status}"``. An env can also emit its own
signal (``Env.signal``); the rules apply to whatever it emits.
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Literal

from pydantic import Field

from libra.config import Section
from libra.signals import SizeClass, ToolSignal, ToolStatus

DEFAULT_STATE = "{tool}:{size}:{status}"


class SignalRule(Section):
    """Matches tool returns by tool name (a glob), size class and status (``*``: any)."""

    tool: str = Field("*", description="tool names it matches, a glob (*: any)")
    size_class: SizeClass | Literal["*"] = Field(
        "*",
        description="output size it matches: small (up to 500 characters), medium (up to "
        "5,000), large; *: any",
    )
    status: ToolStatus | Literal["*"] = Field(
        "*",
        description="status it matches: success, failure (raised, or the output reads like "
        "an error), timeout; *: any",
    )
    action: Literal["keep", "ignore"] = Field(
        "keep",
        description="keep: the return becomes a state (named by state); ignore: the "
        "trajectory's path does not grow",
    )
    state: str = Field(
        DEFAULT_STATE, description="the state's name; {tool}, {size} and {status} are filled in"
    )

    def matches(self, signal: ToolSignal) -> bool:
        return (
            fnmatchcase(signal.tool, self.tool)
            and self.size_class in ("*", signal.size_class)
            and self.status in ("*", signal.status)
        )

    def apply(self, signal: ToolSignal) -> str | None:
        if self.action == "ignore":
            return None
        return self.state.format(tool=signal.tool, size=signal.size_class, status=signal.status)


class SignalMap(Section):
    """Per-env rules (by env name), then ``default`` rules, then ``tool:size:status``."""

    envs: dict[str, list[SignalRule]] = Field(
        default_factory=dict, description="rules per env name, tried before the default rules"
    )
    default: list[SignalRule] = Field(default_factory=list)

    def state(self, env: str, signal: ToolSignal) -> str | None:
        """The state ``signal`` is reduced to in a trajectory of env ``env``, or None
        when the return is ignored."""
        rules: list[SignalRule] = [*self.envs.get(env, []), *self.default]
        for rule in rules:
            if rule.matches(signal):
                return rule.apply(signal)
        return DEFAULT_STATE.format(tool=signal.tool, size=signal.size_class, status=signal.status)
