"""``python_arith``: tasks from the seed, the reward on hand-written answers, and the
model's programs run in a real Docker sandbox."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from envs_contrib.calc import evaluate
from envs_contrib.python_arith import COMPUTED_CREDIT, PythonArith
from libra.engine import TrajectoryJob, TrajectoryRecord, run_trajectory
from libra.sandbox import DockerSandboxProvider
from tests._helpers import emulated_engine

docker = pytest.importorskip("docker", reason="the Docker SDK is not installed")
SEED = 7


def task(seed: int) -> PythonArith:
    env = PythonArith()
    env.reset(seed)
    return env


def block(code: str) -> str:
    return f"```python\n{code}\n```\n"


def test_the_task_is_a_function_of_the_seed() -> None:
    prompts = [(PythonArith().reset(seed), task(seed).expected) for seed in range(50)]
    assert prompts == [(PythonArith().reset(seed), task(seed).expected) for seed in range(50)]
    assert len({prompt for prompt, _ in prompts}) == 50


def test_the_expected_value_is_the_expressions_value() -> None:
    for seed in range(200):
        env = task(seed)
        assert env.expression in PythonArith().reset(seed)
        assert evaluate(env.expression) == env.expected  # an exact evaluator, not eval()
    shapes = {task(seed).expression.count("*") for seed in range(200)}
    assert shapes == {0, 1, 2}  # long sums, products with a term, triple products


def test_the_final_answer_alone_scores_right_or_wrong() -> None:
    env = task(SEED)
    assert env.reward(f"The answer is {env.expected:,}.") == 1.0
    assert env.reward(f"The program printed 42, so the answer is {env.expected}.") == 1.0
    assert env.reward(f"The answer is {env.expected}, or {env.expected + 1}.") == 0.0
    assert env.reward("The answer is N.") == 0.0


# ---------------------------------------------- the model's programs in a real container


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
async def sandboxes(docker_client: docker.DockerClient) -> AsyncIterator[DockerSandboxProvider]:
    async with DockerSandboxProvider(pool_size=1, client=docker_client) as provider:
        yield provider


async def run(replies: list[str], sandboxes: DockerSandboxProvider) -> TrajectoryRecord:
    async with emulated_engine(replies) as (engine, _):
        engine.sandboxes = sandboxes
        record = await run_trajectory(TrajectoryJob(PythonArith, "python_arith", SEED), engine)
    assert record.status == "completed", record.error
    return record


def tool_outputs(record: TrajectoryRecord) -> list[str]:
    return [m.content or "" for m in record.messages if m.role == "tool"]


@pytest.mark.anyio
@pytest.mark.slow
async def test_a_right_program_and_answer_earn_full_reward(
    sandboxes: DockerSandboxProvider,
) -> None:
    env = task(SEED)
    program = block(f"print({env.expression})")
    record = await run([program, f"The answer is {env.expected}."], sandboxes)
    assert tool_outputs(record) == [f"{env.expected}\n"]  # computed in the container
    assert [r.status for r in record.tool_returns] == ["success"]
    assert record.reward == 1.0


@pytest.mark.anyio
@pytest.mark.slow
async def test_a_right_program_misreported_earns_partial_credit(
    sandboxes: DockerSandboxProvider,
) -> None:
    env = task(SEED)
    replies = [block(f"print('result:', {env.expression})"), "The answer is 12."]
    record = await run(replies, sandboxes)
    assert tool_outputs(record) == [f"result: {env.expected}\n"]
    assert record.reward == COMPUTED_CREDIT


@pytest.mark.anyio
@pytest.mark.slow
async def test_wrong_or_failing_programs_earn_nothing(sandboxes: DockerSandboxProvider) -> None:
    env = task(SEED)
    wrong = block(f"print({env.expression} + 1)")
    # Prints the right value, then fails: a run that failed is no computation.
    failing = block(f"print({env.expression})\nraise SystemExit(1)")
    record = await run([wrong, failing, "The answer is 3."], sandboxes)
    assert [r.status for r in record.tool_returns] == ["success", "failure"]
    assert tool_outputs(record)[0] == f"{env.expected + 1}\n"
    assert record.reward == 0.0
