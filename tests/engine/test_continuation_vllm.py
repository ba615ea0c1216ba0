"""A turn that real vLLM's ``/pause`` (abort mode) cuts short goes on, with the server's
own tokens: the record's ids spell the server's rendering of the conversation, and each sampled
span is exactly what one of the server's answers returned."""

from __future__ import annotations

from collections.abc import Mapping

import anyio
import msgspec
import pytest

from libra import openai
from libra.engine import (
    Engine,
    EngineConfig,
    HTTPTransport,
    SamplingConfig,
    TrajectoryJob,
    TrajectoryRecord,
    http_transport,
    run_trajectory,
)
from libra.envs import Env
from libra.fleet import Endpoint
from libra.sched.policies import LeastLoadedScheduler
from libra.serving import VLLMServer
from tests._helpers import REAL_MODEL_NAME

pytestmark = [pytest.mark.slow, pytest.mark.anyio]
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"  # aiohttp


class Story(Env):
    """Asks for a long story: the model writes for seconds, so a pause lands mid-turn."""

    max_turns = 1

    def reset(self, seed: int) -> str:
        return (
            "Write a very long and detailed story about a lighthouse keeper who finds a "
            "message in a bottle. Describe every day of the week in its own paragraph."
        )

    def reward(self, answer: str) -> float:
        return float(bool(answer))


class Answers:
    """The engine's HTTP transport, keeping every ``/v1/completions`` request and answer."""

    def __init__(self, inner: HTTPTransport) -> None:
        self.inner = inner
        self.completions: list[tuple[openai.CompletionRequest, openai.Completion]] = []

    async def post(
        self, url: str, body: bytes, headers: Mapping[str, str], timeout_s: float
    ) -> tuple[int, bytes]:
        status, answer = await self.inner.post(url, body, headers, timeout_s)
        if url.endswith("/v1/completions") and status == 200:
            request = msgspec.json.decode(body, type=openai.CompletionRequest)
            self.completions.append((request, msgspec.json.decode(answer, type=openai.Completion)))
        return status, answer

    async def get(self, url: str, timeout_s: float) -> tuple[int, bytes]:
        return await self.inner.get(url, timeout_s)

    async def aclose(self) -> None:
        await self.inner.aclose()

    async def __aenter__(self) -> Answers:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


async def running_requests(server: VLLMServer, http: HTTPTransport) -> float:
    status, body = await http.get(server.url + "/metrics", 30)
    assert status == 200
    lines = body.decode().splitlines()
    return sum(
        float(line.split()[-1]) for line in lines if line.startswith("vllm:num_requests_running{")
    )


async def tokenize(server: VLLMServer, record: TrajectoryRecord, http: HTTPTransport) -> list[int]:
    """The server's own rendering of the conversation through the model's turn."""
    request = openai.TokenizeRequest(
        model=REAL_MODEL_NAME, messages=record.messages, add_generation_prompt=False
    )
    status, body = await http.post(server.url + "/tokenize", msgspec.json.encode(request), JSON, 60)
    assert status == 200, body
    return msgspec.json.decode(body, type=openai.TokenizeResponse).tokens


async def detokenize(server: VLLMServer, tokens: list[int], http: HTTPTransport) -> str:
    request = openai.DetokenizeRequest(model=REAL_MODEL_NAME, tokens=tokens)
    payload = msgspec.json.encode(request)
    status, body = await http.post(server.url + "/detokenize", payload, JSON, 60)
    assert status == 200, body
    return msgspec.json.decode(body, type=openai.DetokenizeResponse).prompt


async def test_a_turn_paused_in_abort_mode_continues_with_the_servers_own_tokens(
    real_server: VLLMServer,
) -> None:
    sampling = SamplingConfig(temperature=0.0, max_tokens_per_turn=400)
    config = EngineConfig(sampling=sampling, max_context_tokens=2048)
    endpoint = Endpoint(real_server.url, model=REAL_MODEL_NAME, api="tokens", name="vllm")
    async with http_transport() as http:
        answers = Answers(http)
        engine = Engine(answers, LeastLoadedScheduler([endpoint]), config=config)
        records: list[TrajectoryRecord] = []

        async def run() -> None:
            records.append(await run_trajectory(TrajectoryJob.seeded(Story, "story", 0), engine))

        async with anyio.create_task_group() as group:
            group.start_soon(run)
            with anyio.fail_after(60):
                while await running_requests(real_server, http) < 1:  # noqa: ASYNC110
                    await anyio.sleep(0.05)
            await anyio.sleep(1.5)  # a few dozen tokens into the turn
            await real_server.pause("abort")
            assert await real_server.is_paused()
            await anyio.sleep(0.5)
            await real_server.resume()
        assert not await real_server.is_paused()
        (record,) = records
        rendered = await tokenize(real_server, record, http)
        spelled = await detokenize(real_server, record.token_ids, http)
        rendered_text = await detokenize(real_server, rendered, http)

    assert record.status != "failed", record.error
    assert record.turns == 1 and len(record.endpoints) == 1
    pieces = [answer.choices[0] for _, answer in answers.completions]
    assert pieces[0].finish_reason == "abort", "the pause did not land mid-turn"
    assert pieces[-1].finish_reason in ("stop", "length")
    # Each continuation was the token list so far: the prompt plus what was sampled.
    for (before, answer), (after, _) in zip(
        answers.completions, answers.completions[1:], strict=False
    ):
        assert after.prompt == [*before.prompt, *(answer.choices[0].token_ids or [])]
    # The model-token spans are exactly the server's answers, logprobs included.
    sampled = [piece for piece in pieces if piece.token_ids]
    assert len(record.weight_versions) == len(sampled) >= 2
    for span, piece in zip(record.weight_versions, sampled, strict=True):
        assert record.token_ids[span.start : span.end] == piece.token_ids
        assert piece.logprobs is not None
        assert record.logprobs[span.start : span.end] == piece.logprobs.token_logprobs
        assert set(record.loss_mask[span.start : span.end]) == {1}
    # The pieces make one reply, and its ids spell the server's own rendering of the chat:
    # the prompt id for id; the reply as sampled, which where the pause fell can split what
    # the whole text tokenizes into (e.g. "\n" then "\n" where the rendering has "\n\n").
    assert record.messages[-1].content == "".join(piece.text for piece in pieces)
    prompt = record.weight_versions[0].start
    assert record.token_ids[:prompt] == rendered[:prompt]
    assert rendered_text.startswith(spelled)
    if record.stop_reason == "model_stop":
        assert rendered_text[len(spelled) :] in ("", "\n")  # the "\n" after <|im_end|>
