"""The ``Env`` base class: what a user writes to add a task and its tools.

An env is one episode's worth of state. The engine makes a fresh instance per
trajectory, calls :meth:`Env.reset` with the task (or its seed) to get the prompt, lets
the model call the env's ``@tool`` methods, and asks :meth:`Env.reward` for the score of
the final answer. That is the whole contract; everything else has a default::

    class Guess(Env):
        "Find a secret number with a higher/lower oracle."

        def reset(self, seed: int) -> str:
            self.secret = random.Random(seed).randint(1, 100)
            return "I picked a number between 1 and 100. Find it with `guess`."

        @tool
        def guess(self, number: int) -> str:
            "Guess the number; the answer is higher, lower or correct."
            if number == self.secret:
                self.done = True
                return "correct"
            return "higher" if number < self.secret else "lower"

        def reward(self, answer: str) -> float:
            return 1.0 if self.done else 0.0

An env driven by a dataset takes the whole :class:`~libra.envs.Task` instead, whose
``payload`` is the row: ``def reset(self, task: Task)``. Which of the two ``reset``
takes is read from its signature, once per class: a first parameter annotated ``Task``
(or, unannotated, named ``task``) gets the task, any other gets the seed.

Tools may be plain or ``async`` methods. A plain tool runs in a worker thread, so a
slow or hanging one cannot stall the engine; either kind is cancelled after
``tool_timeout_s``. A tool returns text (or anything JSON can encode); one that knows how
its call went returns ``ToolResult(content, status=...)`` (``success``, ``failure`` or
``timeout``) or raises ``ToolError`` / ``ToolTimeout``, and the scheduler sees that
status instead of one read back from the text. Tools that run untrusted code use
``self.sandbox`` (declare ``sandbox_spec``); the engine provides one per trajectory.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar

from libra import openai
from libra.envs._sandbox import Sandbox, SandboxSpec
from libra.envs._task import Task
from libra.envs._tool_calls import HermesToolCallParser, ToolCallParser
from libra.envs._tool_return import ToolReturn
from libra.envs._tools import ToolSpec, is_tool
from libra.signals import ToolSignal

Prompt = str | list[openai.Message]


class Env(ABC):
    #: Name used by ``libra rollout --env``; defaults to the entry point's name.
    name: ClassVar[str] = ""
    #: Optional system message placed before the prompt.
    system_prompt: ClassVar[str | None] = None
    #: Episode limits: the engine truncates a trajectory that reaches them.
    max_turns: ClassVar[int] = 8
    tool_timeout_s: ClassVar[float] = 30.0
    #: A longer tool output reaches the model (and the record) as its start and end
    #: around a note of what was cut.
    max_tool_output_chars: ClassVar[int] = 100_000
    #: Set to get ``self.sandbox`` (a Docker container or bubblewrap jail) per trajectory.
    sandbox_spec: ClassVar[SandboxSpec | None] = None
    #: How inline tool calls are read from the model's text.
    tool_call_parser: ClassVar[ToolCallParser] = HermesToolCallParser()
    #: Strings that end the model's turn (kept in its reply), such as the end of a code
    #: block: its call runs at once instead of waiting for the model to stop writing.
    stop_strings: ClassVar[tuple[str, ...]] = ()

    _tool_specs: ClassVar[dict[str, ToolSpec]] = {}
    _reset_takes_task: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._reset_takes_task = _takes_task(cls.reset)
        cls._tool_specs = {
            name: ToolSpec.from_method(member)
            for name, member in _members(cls).items()
            if is_tool(member)
        }

    def __init__(self) -> None:
        #: Set by a tool (or ``on_reply``) to end the episode after the current turn.
        self.done = False
        #: The conversation so far, kept up to date by the engine (read it, don't edit it).
        self.messages: list[openai.Message] = []
        self._sandbox: Sandbox | None = None

    # --------------------------------------------------------------- what users write

    @abstractmethod
    def reset(self, task: Any) -> str | list[openai.Message]:
        """Build the task and return the prompt (a user message or messages).

        Write it as ``reset(self, seed: int)`` (the task's seed) or ``reset(self, task:
        Task)`` (the whole task, with its payload); typed ``Any`` here so that both
        type-check. May be ``async``. The same task must give the same prompt: GRPO
        samples a task several times.
        """

    @abstractmethod
    def reward(self, answer: str) -> float:
        """Score the episode; ``answer`` is the model's last message. May be ``async``."""

    # ------------------------------------------------------------------ optional hooks

    def on_reply(self, text: str) -> str | None:
        """The model replied without calling a tool.

        Return a message to send back as the user's next turn (e.g. a simulated user or
        a hint), or None to end the episode. May be ``async``.
        """
        return None

    def signal(self, result: ToolReturn) -> ToolSignal:
        """The causal signal the scheduler sees for a tool return; override to refine.

        ``result.status`` is already final: as the tool reported it (a ``ToolResult``, a
        ``ToolError`` or ``ToolTimeout``, the engine's own timeout), or read from the text
        of a plain result.
        """
        return result.signal()

    async def close(self) -> None:  # noqa: B027 (an optional hook, empty on purpose)
        """Release what ``reset`` acquired; called once, however the episode ended."""

    # ------------------------------------------------------------------ for the engine

    def reset_with(self, task: Task) -> Prompt | Awaitable[Prompt]:
        """Call :meth:`reset` with what it takes: the task, or its seed."""
        reset: Callable[[Any], Prompt | Awaitable[Prompt]] = self.reset
        return reset(task if self._reset_takes_task else task.seed)

    @classmethod
    def tool_specs(cls) -> dict[str, ToolSpec]:
        return cls._tool_specs

    @classmethod
    def tool_schemas(cls) -> list[dict[str, Any]]:
        """The tools in the OpenAI function schema (built once per class; don't mutate)."""
        return [spec.schema for spec in cls._tool_specs.values()]

    @property
    def sandbox(self) -> Sandbox:
        if self._sandbox is None:
            raise RuntimeError(
                f"{type(self).__name__} uses self.sandbox but declares no sandbox_spec"
            )
        return self._sandbox

    @sandbox.setter
    def sandbox(self, value: Sandbox) -> None:
        self._sandbox = value


def _takes_task(reset: Callable[..., object]) -> bool:
    """Whether ``reset``'s first parameter (after ``self``) is the task, not its seed."""
    parameters = list(inspect.signature(reset).parameters.values())[1:]
    if not parameters:
        return False
    first = parameters[0]
    if first.annotation is inspect.Parameter.empty:
        return first.name == "task"
    if isinstance(first.annotation, str):  # postponed annotations: the name as written
        return first.annotation.rsplit(".", 1)[-1] == "Task"
    return first.annotation is Task


def _members(cls: type) -> dict[str, Any]:
    """Class attributes along the MRO, subclasses first (so overrides win)."""
    members: dict[str, Any] = {}
    for klass in reversed(cls.__mro__):
        members.update(vars(klass))
    return members
