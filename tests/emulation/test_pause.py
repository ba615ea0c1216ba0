"""The emulated server's /pause, /resume and /is_paused, and the continuation of a turn a
pause cut short (in-process, on real time: the latency model makes generation take it)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anyio
import httpx
import pytest

from libra import openai
from libra.emulation import (
    EOS_ID,
    BatchingEngine,
    ByteTokenizer,
    EmulatorConfig,
    LatencyModel,
    ScriptedReplies,
    create_app,
)
from libra.emulation.workloads._env import _turns_so_far

pytestmark = pytest.mark.anyio

MODEL = "libra-emulated"
REPLY = "a long scripted reply, written one token per step. " * 6  # 306 tokens + EOS
SECOND = "the second turn's reply."
STEP_S = 0.005  # seconds per decode step: the whole reply takes ~1.5 s
tokenizer = ByteTokenizer()


def slow() -> LatencyModel:
    return LatencyModel(
        prefill_s_per_token=0.0, step_base_s=STEP_S, step_per_seq_s=0.0, step_per_ctx_token_s=0.0
    )


async def client_of(latency: LatencyModel) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(EmulatorConfig(latency=latency), ScriptedReplies([REPLY, SECOND]))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://emulated") as client:
        yield client


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async for client in client_of(slow()):
        yield client


def first_turn_prompt() -> list[int]:
    return tokenizer.render_chat([openai.Message(role="user", content="Write.")], None, True)


async def complete(client: httpx.AsyncClient, prompt: list[int], **extra: Any) -> dict[str, Any]:
    # Seeded: a seedless request draws its own reply, and these compare replies.
    body = {"model": MODEL, "prompt": prompt, "logprobs": 0, "return_token_ids": True}
    body |= {"seed": 0, **extra}
    response = await client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    choice: dict[str, Any] = response.json()["choices"][0]
    return choice


async def pause(client: httpx.AsyncClient, mode: str) -> None:
    response = await client.post("/pause", params={"mode": mode})
    assert (response.status_code, response.json()) == (200, {"status": "paused"})


async def resume(client: httpx.AsyncClient) -> None:
    response = await client.post("/resume")
    assert (response.status_code, response.json()) == (200, {"status": "resumed"})


async def is_paused(client: httpx.AsyncClient) -> bool:
    response = await client.get("/is_paused")
    assert response.status_code == 200
    paused: bool = response.json()["is_paused"]
    return paused


class Background:
    """A completion request running in a task; its answer once it has one."""

    def __init__(self) -> None:
        self.choice: dict[str, Any] | None = None
        self.done = anyio.Event()

    async def run(self, client: httpx.AsyncClient, prompt: list[int]) -> None:
        self.choice = await complete(client, prompt)
        self.done.set()


async def test_routes_answer_like_vllm(client: httpx.AsyncClient) -> None:
    assert await is_paused(client) is False
    bad = await client.post("/pause", params={"mode": "later"})
    assert bad.status_code == 422
    assert bad.json()["detail"][0]["loc"] == ["query", "mode"]
    await pause(client, "keep")
    assert await is_paused(client) is True
    await resume(client)
    assert await is_paused(client) is False
    await pause(client, "abort")  # vLLM's default mode, also without the parameter
    await resume(client)
    assert (await client.post("/pause")).json() == {"status": "paused"}
    assert await is_paused(client) is True


async def test_abort_ends_a_request_with_what_it_produced_and_a_continuation_goes_on(
    client: httpx.AsyncClient,
) -> None:
    prompt = first_turn_prompt()
    whole = await complete(client, prompt)
    assert whole["finish_reason"] == "stop" and whole["token_ids"][-1] == EOS_ID

    request = Background()
    async with anyio.create_task_group() as group:
        group.start_soon(request.run, client, prompt)
        await anyio.sleep(0.4)
        await pause(client, "abort")
        await request.done.wait()
    first = request.choice
    assert first is not None and first["finish_reason"] == "abort"
    produced = first["token_ids"]
    assert 0 < len(produced) < len(whole["token_ids"])
    assert produced == whole["token_ids"][: len(produced)]
    assert first["text"] == tokenizer.decode(produced)
    assert (
        first["logprobs"]["token_logprobs"] == whole["logprobs"]["token_logprobs"][: len(produced)]
    )

    # A request sent while paused queues until /resume.
    rest = Background()
    async with anyio.create_task_group() as group:
        group.start_soon(rest.run, client, prompt + produced)
        await anyio.sleep(0.3)
        assert not rest.done.is_set()
        await resume(client)
    second = rest.choice
    assert second is not None and second["finish_reason"] == "stop"
    # The prompt ended inside the assistant turn: the reply goes on where it stopped,
    # with the logprobs the uninterrupted turn had.
    assert produced + second["token_ids"] == whole["token_ids"]
    joined = first["logprobs"]["token_logprobs"] + second["logprobs"]["token_logprobs"]
    assert joined == whole["logprobs"]["token_logprobs"]


async def test_a_partial_later_turn_continues_that_turn_not_the_next(
    client: httpx.AsyncClient,
) -> None:
    messages = [
        openai.Message(role="user", content="Write."),
        openai.Message(role="assistant", content=REPLY),
        openai.Message(role="user", content="Again."),
    ]
    prompt = tokenizer.render_chat(messages, None, True)
    whole = await complete(client, prompt)
    assert whole["token_ids"] == [*tokenizer.encode(SECOND), EOS_ID]
    partial = tokenizer.encode(SECOND[:10])
    rest = await complete(client, prompt + partial, max_tokens=5)
    assert (rest["finish_reason"], rest["token_ids"]) == ("length", tokenizer.encode(SECOND[10:15]))
    assert _turns_so_far(tokenizer.decode(prompt + partial)) == 1
    assert _turns_so_far(tokenizer.decode(prompt)) == 1


async def test_wait_lets_running_requests_finish_and_holds_new_ones(
    client: httpx.AsyncClient,
) -> None:
    prompt = first_turn_prompt()
    running, queued = Background(), Background()
    async with anyio.create_task_group() as group:
        group.start_soon(running.run, client, prompt)
        await anyio.sleep(0.3)
        started = anyio.current_time()
        await pause(client, "wait")  # answers once the running request has finished
        assert anyio.current_time() - started > 0.8  # of the ~1.5 s the reply takes
        with anyio.fail_after(0.5):
            await running.done.wait()
        group.start_soon(queued.run, client, prompt)
        await anyio.sleep(0.3)
        assert not queued.done.is_set()
        await resume(client)
    assert running.choice is not None and running.choice["finish_reason"] == "stop"
    assert queued.choice is not None and queued.choice["token_ids"] == running.choice["token_ids"]


async def test_keep_freezes_running_requests_until_resume(client: httpx.AsyncClient) -> None:
    prompt = first_turn_prompt()
    started = anyio.current_time()
    whole = await complete(client, prompt)
    uninterrupted_s = anyio.current_time() - started

    request = Background()
    started = anyio.current_time()
    async with anyio.create_task_group() as group:
        group.start_soon(request.run, client, prompt)
        await anyio.sleep(0.3)
        await pause(client, "keep")
        await anyio.sleep(1.0)
        assert not request.done.is_set()
        await resume(client)
    frozen_s = anyio.current_time() - started
    assert request.choice is not None
    assert (request.choice["finish_reason"], request.choice["token_ids"]) == (
        "stop",
        whole["token_ids"],
    )
    assert frozen_s > uninterrupted_s + 0.8


async def test_chat_requests_are_aborted_too(client: httpx.AsyncClient) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Write."}],
        "return_token_ids": True,
    }
    async with anyio.create_task_group() as group:

        async def chat() -> None:
            response = await client.post("/v1/chat/completions", json=body)
            choices.append(response.json()["choices"][0])

        choices: list[dict[str, Any]] = []
        group.start_soon(chat)
        await anyio.sleep(0.3)
        await pause(client, "abort")
    (choice,) = choices
    assert choice["finish_reason"] == "abort"
    assert 0 < len(choice["token_ids"]) < len(tokenizer.encode(REPLY))
    assert REPLY.startswith(choice["message"]["content"])


async def test_without_latency_a_pause_holds_new_requests() -> None:
    async for client in client_of(LatencyModel.zero()):
        await pause(client, "abort")
        assert await is_paused(client) is True
        request = Background()
        async with anyio.create_task_group() as group:
            group.start_soon(request.run, client, first_turn_prompt())
            await anyio.sleep(0.2)
            assert not request.done.is_set()
            await resume(client)
        assert request.choice is not None and request.choice["finish_reason"] == "stop"
        assert await is_paused(client) is False


async def test_abort_ends_queued_requests_too_and_later_ones_wait_for_resume() -> None:
    engine = BatchingEngine(slow().model_copy(update={"max_num_seqs": 1}))
    produced: dict[str, int] = {}

    async def request(name: str, tokens: int) -> None:
        produced[name] = await engine.generate(10, tokens)

    async with anyio.create_task_group() as group:
        group.start_soon(request, "first", 200)
        group.start_soon(request, "second", 200)  # one runs, the other waits its turn
        await anyio.sleep(0.2)
        assert (engine.num_running, engine.num_waiting) == (1, 1)
        engine.pause("abort")
        assert (engine.num_running, engine.num_waiting, engine.paused) == (0, 0, "abort")
        group.start_soon(request, "later", 20)
        await anyio.sleep(0.2)
        assert "later" not in produced and engine.num_waiting == 1
        engine.resume()
    queued, running = sorted((produced["first"], produced["second"]))
    assert queued == 0 and 0 < running < 200
    assert produced["later"] == 20
    assert engine.paused is None and engine.num_running == 0
