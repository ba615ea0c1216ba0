"""The contributed envs whose tools run in a real Docker sandbox, driven by the engine."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import pytest

from envs_contrib.code_tests import CodeTests
from envs_contrib.python_math import PythonMath
from libra.engine import TrajectoryJob, TrajectoryRecord, run_trajectory
from libra.envs import Env
from libra.sandbox import DockerSandboxProvider
from tests._helpers import emulated_engine

if TYPE_CHECKING:
    import docker


pytest.importorskip("docker", reason="the Docker SDK is not installed")
SEED_RUN_LENGTH = 0  # a task seed whose problem is run_length


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
async def sandboxes(docker_client: docker.DockerClient) -> AsyncIterator[DockerSandboxProvider]:
    async with DockerSandboxProvider(pool_size=2, client=docker_client) as provider:
        yield provider


async def run(
    env: type[Env], seed: int, replies: list[str], sandboxes: DockerSandboxProvider
) -> TrajectoryRecord:
    async with emulated_engine(replies) as (engine, _):
        engine.sandboxes = sandboxes
        return await run_trajectory(TrajectoryJob.seeded(env, env.__name__.lower(), seed), engine)


def call(name: str, code: str) -> str:
    import json

    return "<tool_call>" + json.dumps({"name": name, "arguments": {"code": code}}) + "</tool_call>"


@pytest.mark.anyio
@pytest.mark.slow
async def test_python_math_runs_code_in_the_container(sandboxes: DockerSandboxProvider) -> None:
    env = PythonMath()
    env.reset(3)
    code = "import os, socket\nprint(os.getuid())\nsocket.create_connection(('1.1.1.1', 53), 2)"
    record = await run(
        PythonMath, 3, [call("run_python", code), f"The answer is {env.expected}."], sandboxes
    )
    [tool_output] = [m.content or "" for m in record.messages if m.role == "tool"]
    assert tool_output.startswith("65534\n")  # not root
    assert "OSError" in tool_output  # no network
    assert (record.status, record.reward) == ("completed", 1.0)
    assert record.tool_returns[0].status == "failure"  # the traceback reads as a failure


@pytest.mark.anyio
@pytest.mark.slow
async def test_code_tests_scores_hidden_tests(sandboxes: DockerSandboxProvider) -> None:
    env = CodeTests()
    env.reset(0)
    name = env.problem.name
    # Cheat attempt: look for the expected answers anywhere the code can read.
    snoop = (
        "import os, sys\n"
        "found = [p for r, _, fs in os.walk('/') if not r.startswith(('/proc', '/sys'))"
        " for p in fs if 'expected' in p]\n"
        f"def {name}(*a):\n    raise RuntimeError(f'files={{found}} argv={{sys.argv[1:]}}')\n"
    )
    wrong = f"def {name}(*args):\n    return None\n"
    replies = [call("run_tests", snoop), call("run_tests", wrong), "done"]
    record = await run(CodeTests, 0, replies, sandboxes)
    snooped = record.messages[3].content or ""
    assert "0/12 tests passed" in snooped and "files=[] argv=['" + name + "']" in snooped
    assert "0/12 tests passed" in (record.messages[5].content or "")
    assert record.reward == 0.0


@pytest.mark.anyio
@pytest.mark.slow
async def test_code_tests_full_marks_for_a_correct_solution(
    sandboxes: DockerSandboxProvider,
) -> None:
    env = CodeTests()
    env.reset(SEED_RUN_LENGTH)
    assert env.problem.name == "run_length"
    solution = (
        "import itertools\n"
        "def run_length(text):\n"
        "    return ''.join(f'{k}{len(list(g))}' for k, g in itertools.groupby(text))\n"
    )
    replies = [call("run_tests", solution), "done"]
    record = await run(CodeTests, SEED_RUN_LENGTH, replies, sandboxes)
    assert record.messages[3].content == "12/12 tests passed."
    assert record.reward == 1.0
