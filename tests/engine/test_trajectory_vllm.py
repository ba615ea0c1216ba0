"""The engine on real parts: vLLM serving the embedded model, tools in Docker containers."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import msgspec
import pytest

from envs_contrib.python_math import PythonMath
from libra import openai
from libra.engine import (
    Engine,
    EngineConfig,
    SamplingConfig,
    TrajectoryRecord,
    http_transport,
    jobs_for,
    rollout,
)
from libra.fleet import Endpoint
from libra.sandbox import DockerSandboxProvider
from libra.sched.policies import LeastLoadedScheduler
from libra.serving import VLLMServer
from tests._helpers import REAL_MODEL_NAME

if TYPE_CHECKING:
    import docker

pytestmark = [pytest.mark.slow, pytest.mark.anyio]
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"  # the HTTP transport's protocols and the Docker SDK's threads


@pytest.fixture(scope="module")
async def sandboxes(docker_client: docker.DockerClient) -> AsyncIterator[DockerSandboxProvider]:
    async with DockerSandboxProvider(pool_size=4, client=docker_client) as provider:
        yield provider


async def greedy_rollout(
    server: VLLMServer, sandboxes: DockerSandboxProvider | None, n: int
) -> list[TrajectoryRecord]:
    sampling = SamplingConfig(temperature=0.0, max_tokens_per_turn=256)
    # vLLM on two loaded CPU cores is slow, not hung: in the full suite it sampled 7-14
    # tokens/s over six requests, so a 256-token turn can take minutes, past the default
    # 30 s + 0.05 s a token after which a call is taken as hung (a record was lost so).
    config = EngineConfig(
        sampling=sampling, max_turns=3, max_context_tokens=2048, call_timeout_s=300.0
    )
    records: list[TrajectoryRecord] = []
    async with http_transport() as http:
        endpoint = Endpoint(server.url, model=REAL_MODEL_NAME)
        engine = Engine(
            http,
            LeastLoadedScheduler([endpoint]),
            config=config,
            sandboxes=sandboxes,
            on_record=records.append,
        )
        await rollout(jobs_for(PythonMath, "python_math", n, seed=0), engine)
    return records


async def tokenize(server: VLLMServer, record: TrajectoryRecord) -> list[int]:
    """The server's own rendering of the conversation through the last model turn."""
    last = max(i for i, m in enumerate(record.messages) if m.role == "assistant")
    request = openai.TokenizeRequest(
        model=REAL_MODEL_NAME, messages=record.messages[: last + 1], add_generation_prompt=False
    )
    async with http_transport() as http:
        status, body = await http.post(
            server.url + "/tokenize", msgspec.json.encode(request), JSON, 60
        )
    assert status == 200, body
    return msgspec.json.decode(body, type=openai.TokenizeResponse).tokens


async def test_python_math_on_vllm_with_docker_tools(
    real_server: VLLMServer, sandboxes: DockerSandboxProvider
) -> None:
    records = await greedy_rollout(real_server, sandboxes, 6)
    failed = [(r.id, r.stop_reason, r.error) for r in records if r.status == "failed"]
    assert len(records) == 6 and not failed, failed
    for record in records:
        assert record.tokens == "exact"
        assert len(record.token_ids) == len(record.loss_mask) == len(record.logprobs)
        assert all(
            (lp is not None) == (m == 1)
            for m, lp in zip(record.loss_mask, record.logprobs, strict=True)
        )
        assert all(lp is None or lp <= 0 for lp in record.logprobs)
        # The tool schema reached the model through the system message (SmolLM2's chat
        # template drops `tools`), and the ids are exactly the server's own rendering.
        assert "```python" in (record.messages[0].content or "")
        rendered = await tokenize(real_server, record)
        if record.stop_reason == "model_stop":
            assert record.token_ids == rendered[: len(record.token_ids)]
            assert len(rendered) - len(record.token_ids) <= 1  # the "\n" after <|im_end|>
    # Turns that ended at a code block's closing fence (python_math's stop string) are
    # closed with the template's <|im_end|> (id 2), a context token the model did not sample.
    fence_stops = [
        (record, span)
        for record in records
        for span, reply in zip(
            record.weight_versions,
            [m for m in record.messages if m.role == "assistant"],
            strict=True,
        )
        if (reply.content or "").endswith(PythonMath.stop_strings[0])
        and span.end < len(record.token_ids)
    ]
    assert fence_stops, "greedy SmolLM2 closes some code blocks"
    for record, span in fence_stops:
        assert (record.token_ids[span.end], record.loss_mask[span.end]) == (2, 0)
    with_tools = [r for r in records if r.tool_returns and r.turns >= 2]
    assert with_tools, "greedy SmolLM2 writes code for some of these tasks"
    record = with_tools[0]
    tool_message = next(m for m in record.messages if m.role == "tool")
    assert tool_message.content  # what the program printed in the container (or its error)
    assert record.tool_returns[0].latency_s > 0
