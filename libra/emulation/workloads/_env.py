"""The two ends of an emulated workload: an env whose tools play the script, and a
model (an emulator :class:`~libra.emulation.Script`) that plays the same script.

The prompt opens with a tag, ``[libra-workload NAME step=S task=T]``, and ends with
``[sample=K]``, so the emulated server, which sees only the conversation, knows which
trajectory it is writing and which turn it is on (the samples of a task share all of
their prompt but its end, so the prefix cache shares it as GRPO's samples share
theirs): it replies with exactly the scripted number of tokens and the scripted tool
call. The env's tools answer each call with the scripted output (its
size, and its status, reported as such) after the scripted latency; a scripted timeout
sleeps past the tool timeout, so the engine times it out as it would a real tool.
Nothing here is mocked: the engine, the HTTP client, the scheduler and the batching
server all run unchanged.
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable
from typing import ClassVar

import anyio

from libra.emulation._scripts import Conversation, Reply
from libra.emulation.workloads._format import Workload
from libra.emulation.workloads._trajectory_scripts import (
    Book,
    ScriptBook,
    ScriptTurn,
    TrajectoryScript,
)
from libra.envs import Env, ToolResult, tool

_TAG = re.compile(r"\[libra-workload (\S+) step=(\d+) task=(\d+)\]")
_SAMPLE_TAG = re.compile(r"\[sample=(\d+)\]")
_FILLER = "the model reasons about the task and the last tool result step by step. " * 64
_TRACEBACK = "Traceback (most recent call last):\n"


def _filler(length: int) -> str:
    """Exactly ``length`` characters (= tokens for the emulator's byte tokenizer)."""
    if length <= 0:
        return ""
    repeats = length // len(_FILLER) + 1
    return (_FILLER * repeats)[:length]


def prompt_text(script: TrajectoryScript) -> str:
    """The task's prompt, the same for all its samples up to the sample's tag at its end."""
    tag = f"[libra-workload {script.workload} step={script.step} task={script.task_seed}]\n"
    sample = f"\n[sample={script.sample}]"
    return tag + _filler(script.prompt_tokens - len(tag) - len(sample)) + sample


def tool_call_text(name: str, turn: int) -> str:
    body = json.dumps({"name": name, "arguments": {"turn": turn}})
    return f"<tool_call>\n{body}\n</tool_call>"


def tool_output(turn: ScriptTurn) -> str:
    """The tool's answer as the model reads it: a traceback for a failure."""
    if turn.status == "failure":
        return _TRACEBACK + _filler(turn.output_chars - len(_TRACEBACK))
    return _filler(turn.output_chars)


def scripted_result(turn: ScriptTurn) -> ToolResult:
    """The tool's answer with its scripted status, which the scheduler sees as it is."""
    return ToolResult(tool_output(turn), turn.status)


_ASSISTANT = "<|im_start|>assistant\n"
_END = "<|im_end|>"


def _turns_so_far(prompt: str) -> int:
    """Closed assistant turns in a ChatML prompt: neither the open generation prompt nor
    a turn the prompt ends inside (a partial turn being continued) counts; the same as
    ``Conversation.turn`` without parsing every message of a long chat."""
    last = prompt.rfind(_ASSISTANT)
    is_open = last >= 0 and _END not in prompt[last:]
    return prompt.count(_ASSISTANT) - is_open


class WorkloadScript:
    """The emulated model of a workload: replies as the trajectory's script says."""

    def __init__(self, book: Book) -> None:
        self.book = book

    def __call__(self, conversation: Conversation, /) -> Reply:
        script = self.script_of(conversation)
        index = _turns_so_far(conversation.prompt_text)
        if index >= len(script.turns):  # the engine gave it another turn: just answer
            return Reply("The answer is 0.")
        turn = script.turns[index]
        if turn.tool is None:
            return Reply(_filler(turn.output_tokens - 1))  # the server appends the EOS
        call = tool_call_text(turn.tool, index)
        return Reply(_filler(turn.output_tokens - 1 - len(call)) + call)

    def script_of(self, conversation: Conversation) -> TrajectoryScript:
        # The tags open and close the first user message: found without parsing the chat.
        text = conversation.prompt_text
        match = _TAG.search(text)
        if match is None or match.group(1) not in self.book.names:
            raise ValueError("the prompt carries no tag of this workload")
        sample = _SAMPLE_TAG.search(text, match.end())
        if sample is None:
            raise ValueError("the prompt carries no sample tag")
        step, task = (int(group) for group in match.groups()[1:])
        return self.book.script(step, task, int(sample.group(1)), match.group(1))


class WorkloadEnv(Env):
    """Plays one trajectory of a workload (subclasses fix the workload, step, sample)."""

    book: ClassVar[ScriptBook]
    step: ClassVar[int]
    sample: ClassVar[int]

    def reset(self, seed: int) -> str:
        self.script = self.book.script(self.step, seed, self.sample)
        return prompt_text(self.script)

    async def play(self, name: str, turn: int) -> ToolResult:
        """The scripted answer to the tool call of model turn ``turn``."""
        if not 0 <= turn < len(self.script.turns) or self.script.turns[turn].tool != name:
            return ToolResult.failure(f"{name} was not expected on turn {turn}")
        scripted = self.script.turns[turn]
        if scripted.status == "timeout":
            await anyio.sleep(self.tool_timeout_s * 2)  # the engine cuts it at the timeout
        await anyio.sleep(scripted.latency_s)
        return scripted_result(scripted)

    def reward(self, answer: str) -> float:
        return 1.0 if self.script.solved else 0.0


ToolMethod = Callable[[WorkloadEnv, int], Awaitable[ToolResult]]


def _tool_method(name: str, description: str) -> ToolMethod:
    async def call(self: WorkloadEnv, turn: int) -> ToolResult:
        return await self.play(name, turn)

    call.__name__ = call.__qualname__ = name
    call.__doc__ = f"{description}\n\nArgs:\n    turn: the model turn making the call"
    call.__annotations__ = {"turn": int, "return": ToolResult}
    return tool(call)


class EnvClasses:
    """One env class per (workload, step, sample) of a workload or a mixed step, made
    once: each plays its own workload's tools within its limits."""

    def __init__(self, book: Book) -> None:
        self.book = book
        self._classes: dict[tuple[str, int, int], type[WorkloadEnv]] = {}
        self._tools = {name: _tools_of(book.part(name).workload) for name in book.names}

    def __call__(self, step: int, sample: int, workload: str | None = None) -> type[WorkloadEnv]:
        """The class of sample ``sample`` at ``step`` (of ``workload``: a mixture's part)."""
        name = workload or self.book.names[0]
        key = (name, step, sample)
        if key not in self._classes:
            book = self.book.part(name)
            limits = book.workload.limits
            attributes = {
                "name": name,
                "book": book,
                "step": step,
                "sample": sample,
                "max_turns": limits.max_turns,
                "tool_timeout_s": limits.tool_timeout_s,
                **self._tools[name],
            }
            class_name = f"{name.replace('-', '_')}_step{step}_sample{sample}"
            self._classes[key] = type(class_name, (WorkloadEnv,), attributes)
        return self._classes[key]


def _tools_of(workload: Workload) -> dict[str, ToolMethod]:
    descriptions = {tool.name: tool.description for tool in workload.explore}
    descriptions.setdefault(workload.check.name, workload.check.description)
    return {name: _tool_method(name, text) for name, text in descriptions.items()}
