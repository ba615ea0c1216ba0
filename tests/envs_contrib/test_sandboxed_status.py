"""The contributed envs that run code report the sandbox's verdict (exit status, timeout)
as the tool's status: it reaches the record and the scheduler as such, not read from text."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from functools import partial
from typing import TYPE_CHECKING, ClassVar

import anyio
import pytest

from envs_contrib.code_tests import CodeTests
from envs_contrib.python_math import PythonMath
from libra.engine import TrajectoryJob, TrajectoryRecord, run_trajectory
from libra.envs import Env
from libra.sandbox import DockerSandboxProvider
from tests._helpers import PathRecorder, emulated_engine

if TYPE_CHECKING:
    import docker


pytest.importorskip("docker", reason="the Docker SDK is not installed")
pytestmark = [pytest.mark.anyio, pytest.mark.slow]
SEED_RUN_LENGTH = 0  # a code_tests seed whose problem is run_length

RUN_LENGTH = """
def run_length(text):
    out, i = [], 0
    while i < len(text):
        j = i
        while j < len(text) and text[j] == text[i]:
            j += 1
        out.append(f"{text[i]}{j - i}")
        i = j
    return "".join(out)
"""
FOREVER = "while True:\n    pass\n"
FOREVER_TESTED = "def run_length(text):\n    while True:\n        pass\n"


class QuickPythonMath(PythonMath):
    program_timeout_s: ClassVar[float] = 1.0


class QuickCodeTests(CodeTests):
    tests_timeout_s: ClassVar[float] = 1.0


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
async def sandboxes(docker_client: docker.DockerClient) -> AsyncIterator[DockerSandboxProvider]:
    async with DockerSandboxProvider(pool_size=1, client=docker_client) as provider:
        yield provider


def call(name: str, code: str) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": {"code": code}}) + "</tool_call>"


async def run(
    env: type[Env], seed: int, replies: list[str], sandboxes: DockerSandboxProvider
) -> tuple[TrajectoryRecord, list[str]]:
    """The record, and the tool-return states the scheduler was told, in order."""
    policy = PathRecorder()
    async with emulated_engine(replies, scheduler=policy) as (engine, _):
        engine.sandboxes = sandboxes
        record = await run_trajectory(TrajectoryJob.seeded(env, env.name or "env", seed), engine)
    assert record.status == "completed", record.error
    return record, policy.paths[record.id]


async def test_python_math_reports_a_sandbox_timeout_as_a_timeout(
    sandboxes: DockerSandboxProvider,
) -> None:
    programs = [
        FOREVER,
        "print('no answer')\nraise SystemExit(3)",  # fails, though no error text says so
        "print('Error: is only a word here')",  # succeeds, though its text reads as an error
    ]
    replies = ["\n".join(call("run_python", code) for code in programs), "The answer is 0."]
    record, path = await run(QuickPythonMath, 1, replies, sandboxes)
    assert [r.status for r in record.tool_returns] == ["timeout", "failure", "success"]
    outputs = [m.content or "" for m in record.messages if m.role == "tool"]
    assert outputs[0].endswith("Error: the program ran longer than 1 s and was killed")
    assert outputs[1] == "no answer\n\n(exit code 3)"
    assert path == [
        "run_python:small:timeout",
        "run_python:small:failure",
        "run_python:small:success",
    ]


async def test_code_tests_reports_failing_tests_and_a_timeout(
    sandboxes: DockerSandboxProvider,
) -> None:
    wrong = "def run_length(text):\n    return ''\n"
    replies = [call("run_tests", code) for code in (FOREVER_TESTED, wrong, RUN_LENGTH)]
    record, path = await run(QuickCodeTests, SEED_RUN_LENGTH, [*replies, "done"], sandboxes)
    outputs = [m.content or "" for m in record.messages if m.role == "tool"]
    assert outputs[0] == "Error: the tests ran longer than 1 s and were stopped"
    assert outputs[2] == "12/12 tests passed."
    assert [r.status for r in record.tool_returns] == ["timeout", "failure", "success"]
    assert path == [f"run_tests:small:{status}" for status in ("timeout", "failure", "success")]
    assert record.reward == 1.0


@pytest.mark.faults
async def test_a_container_killed_under_a_program_fails_the_trajectory_as_a_sandbox_error(
    sandboxes: DockerSandboxProvider, docker_client: docker.DockerClient
) -> None:
    """Not the model's failure: no tool failure for it to learn from, no reward."""
    replies = [call("run_python", "import time\ntime.sleep(60)"), "The answer is 0."]
    async with emulated_engine(replies) as (engine, records):
        engine.sandboxes = sandboxes
        ours = {"name": f"libra-{sandboxes.run_id}-"}  # never another run's containers

        async def kill_the_busy_container() -> None:
            with anyio.fail_after(30):
                find = partial(running_the_program, docker_client, ours)
                while (busy := await anyio.to_thread.run_sync(find)) is None:  # noqa: ASYNC110 (Docker signals nothing)
                    await anyio.sleep(0.2)
            await anyio.to_thread.run_sync(docker_client.api.kill, busy)

        async with anyio.create_task_group() as group:
            group.start_soon(kill_the_busy_container)
            record = await run_trajectory(
                TrajectoryJob.seeded(SlowPythonMath, "python_math", 1), engine
            )
    assert records == [record]  # one record, and only one
    assert (record.status, record.stop_reason, record.reward) == ("failed", "sandbox_error", None)
    assert record.error is not None and "container died during the call" in record.error
    assert record.tool_returns == []  # nothing reached the model as the tool's answer


def running_the_program(client: docker.DockerClient, ours: dict[str, str]) -> str | None:
    """The id of our container whose program is running, if one is by now."""
    for container in client.containers.list(filters=ours):
        processes = client.api.top(container.id)["Processes"] or []
        if any("python" in " ".join(process) for process in processes):
            return str(container.id)
    return None


class SlowPythonMath(PythonMath):
    program_timeout_s: ClassVar[float] = 60.0
