"""Typed tool results: a tool says how its call went, and the scheduler sees just that."""

from __future__ import annotations

import json
from typing import Any

import anyio
import pytest

from libra.engine import TrajectoryJob, TrajectoryRecord, run_trajectory
from libra.envs import Env, ExecResult, ToolError, ToolResult, ToolTimeout, tool
from libra.signals import ToolStatus
from tests._helpers import PathRecorder, emulated_engine

TRACEBACK = "Traceback (most recent call last):\n  ZeroDivisionError: division by zero"


class Reporting(Env):
    """Tools that report their status, and tools that leave it to be read from their text."""

    max_turns = 3
    tool_timeout_s = 0.3

    def reset(self, seed: int) -> str:
        return "Call the tools."

    @tool
    def reported(self, text: str, status: ToolStatus) -> ToolResult:
        """Answer ``text``, reporting ``status``."""
        return ToolResult(text, status)

    @tool
    async def out_of_budget(self) -> str:
        """Give up when its own time budget runs out."""
        raise ToolTimeout("the search used up its 2 s budget")

    @tool
    def refuse(self) -> str:
        """Refuse."""
        raise ToolError("not today")

    @tool
    def plain(self, text: str) -> str:
        """Answer ``text`` as it is."""
        return text

    @tool
    def data(self) -> dict[str, int]:
        """Answer with data, as JSON."""
        return {"passed": 3, "failed": 0}

    @tool
    def bad_status(self) -> ToolResult:
        """A bug: a status the signal does not know."""
        return ToolResult("done", "error")  # type: ignore[arg-type]

    @tool
    async def hang(self) -> str:
        """Never answer."""
        await anyio.sleep_forever()
        return ""

    def reward(self, answer: str) -> float:
        return 0.0


def call(name: str, **arguments: Any) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


async def run_calls(*calls: str) -> tuple[TrajectoryRecord, list[str]]:
    """One model turn making ``calls``, then an answer; the record and the states the
    scheduler was told, in order."""
    policy = PathRecorder()
    async with emulated_engine(["\n".join(calls), "done"], scheduler=policy) as (engine, _):
        record = await run_trajectory(TrajectoryJob.seeded(Reporting, "reporting", 0), engine)
    assert record.status == "completed", record.error
    return record, policy.paths[record.id]


def tool_messages(record: TrajectoryRecord) -> list[str]:
    return [m.content or "" for m in record.messages if m.role == "tool"]


# ------------------------------------------------------------------ the types alone


def test_a_tool_result_succeeds_unless_it_says_otherwise() -> None:
    assert ToolResult("42").status == "success"
    assert ToolResult("partial", "timeout").status == "timeout"


def test_a_tool_result_refuses_an_unknown_status_or_content_that_is_not_text() -> None:
    with pytest.raises(ValueError, match="status"):
        ToolResult("done", "error")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="content"):
        ToolResult({"a": 1})  # type: ignore[arg-type]


def test_a_tool_error_reads_as_a_failure_and_a_tool_timeout_as_a_timeout() -> None:
    assert ToolResult.of_error(ToolError("no such file")) == ToolResult(
        "Error: no such file", "failure"
    )
    assert ToolResult.of_error(ToolTimeout("out of time")) == ToolResult(
        "Error: out of time", "timeout"
    )
    assert str(ToolTimeout.after("search", 1.5)) == "search timed out after 1.5 s"


@pytest.mark.parametrize(
    ("result", "status"),
    [
        (ExecResult(0, "4\n", ""), "success"),
        (ExecResult(1, "", "Traceback ..."), "failure"),
        (ExecResult(137, "", ""), "failure"),  # killed: out of memory
        (ExecResult(-9, "partial", "", timed_out=True), "timeout"),
        (ExecResult(0, "", "", timed_out=True), "timeout"),
    ],
)
def test_an_exec_result_maps_its_exit_status_to_the_signal(
    result: ExecResult, status: ToolStatus
) -> None:
    assert result.status == status


# ------------------------------------------------------- through the engine, to the scheduler


@pytest.mark.anyio
async def test_each_reported_status_reaches_the_record_and_the_scheduler() -> None:
    record, path = await run_calls(
        call("reported", text=TRACEBACK, status="success"),  # not guessed from the text
        call("reported", text="12/12 passed", status="failure"),
        call("reported", text="x" * 600, status="timeout"),
    )
    assert [(r.tool, r.status, r.size_class) for r in record.tool_returns] == [
        ("reported", "success", "small"),
        ("reported", "failure", "small"),
        ("reported", "timeout", "medium"),
    ]
    assert tool_messages(record) == [TRACEBACK, "12/12 passed", "x" * 600]
    assert path == [
        "reported:small:success",
        "reported:small:failure",
        "reported:medium:timeout",
    ]


@pytest.mark.anyio
async def test_a_tool_that_runs_out_of_its_own_time_is_a_timeout_not_a_failure() -> None:
    record, path = await run_calls(call("out_of_budget"), call("refuse"), call("hang"))
    assert [r.status for r in record.tool_returns] == ["timeout", "failure", "timeout"]
    assert tool_messages(record) == [
        "Error: the search used up its 2 s budget",
        "Error: not today",
        "Error: hang timed out after 0.3 s",  # the engine's own cut: a timeout as well
    ]
    assert path == [
        "out_of_budget:small:timeout",
        "refuse:small:failure",
        "hang:small:timeout",
    ]


@pytest.mark.anyio
async def test_plain_results_keep_their_status_read_from_the_text() -> None:
    record, path = await run_calls(
        call("plain", text=TRACEBACK), call("plain", text="fine"), call("data")
    )
    assert [r.status for r in record.tool_returns] == ["failure", "success", "success"]
    assert tool_messages(record)[2] == '{"passed": 3, "failed": 0}'
    assert path == ["plain:small:failure", "plain:small:success", "data:small:success"]


@pytest.mark.anyio
async def test_a_result_with_an_unknown_status_is_the_env_s_error_shown_as_a_failure() -> None:
    record, path = await run_calls(call("bad_status"))
    [message] = tool_messages(record)
    assert message.startswith("Error: ValueError: ToolResult.status must be one of")
    assert path == ["bad_status:small:failure"]
