"""The gateway's HTTP surface, in-process: the official ``openai`` SDK (async) over
``httpx2.ASGITransport`` against the gateway, its core on the emulated server. Chat with
tool calls (whole and streamed), completions, the 400s that name the field, keys, size
limits, metrics, and a client that disconnects."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx2
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam

from libra._asgi import ASGIMessage
from libra.emulation import LatencyModel
from libra.engine import Engine, EngineConfig, http_transport
from libra.events import EventBus
from libra.fleet import Endpoint
from libra.gateway import GatewayConfig, Sessions
from libra.gateway._app import GatewayApp, create_gateway
from libra.gateway._auth import Keys
from libra.gateway._metrics import GatewayMetrics
from libra.openai import ADMIN_HEADER, SESSION_HEADER
from libra.sched.policies import LeastLoadedScheduler
from libra.serving import WEIGHTS_FILE, VLLMServer
from tests._helpers import CALCULATOR, MODEL, REAL_MODEL_NAME, PathRecorder, emulated_engine

pytestmark = pytest.mark.anyio

USER_KEY, ADMIN_KEY = "user-key-1", "admin-key-1"
KEYS = Keys.of([USER_KEY], [ADMIN_KEY])
TOOLS: list[ChatCompletionToolParam] = [CALCULATOR]  # type: ignore[list-item]
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6 * 7"}}\n</tool_call>'
REPLIES = ["Let me compute. " + CALL, "It is 42."]
QUESTION: list[ChatCompletionMessageParam] = [
    {"role": "developer", "content": "You are careful."},
    {"role": "user", "content": [{"type": "text", "text": "What is 6 times 7?"}]},
]
# The SDK stops reading a stream at ``[DONE]`` and leaves its SSE decoder's async
# generators to the garbage collector, which trio reports (and warnings are errors here).
sdk_stream_generators = pytest.mark.filterwarnings(
    "ignore:Exception ignored in. <async_generator object "
    "(SSEDecoder|AsyncStream|Response|ChatCompletionStream):pytest.PytestUnraisableExceptionWarning"
)


@asynccontextmanager
async def gateway(
    replies: list[str] | None = None, keys: Keys = KEYS, **options: Any
) -> AsyncIterator[tuple[GatewayApp, Sessions, PathRecorder]]:
    """The gateway over an in-process emulated server; ``options`` go to the app or, for
    the emulator's ``latency``, to the emulator."""
    scheduler, bus = PathRecorder(), EventBus()
    emulator = {"latency": options.pop("latency")} if "latency" in options else {}
    async with (
        emulated_engine(replies or REPLIES, scheduler=scheduler, events=bus, **emulator) as (
            engine,
            _,
        ),
        Sessions(engine, GatewayConfig()) as core,
    ):
        metrics = GatewayMetrics(scheduler.router, bus)
        yield create_gateway(core, keys, metrics=metrics, **options), core, scheduler


def client(app: GatewayApp, key: str = USER_KEY) -> openai.AsyncOpenAI:
    transport = httpx2.ASGITransport(app=app)
    return openai.AsyncOpenAI(
        base_url="http://gateway/v1",
        api_key=key,
        http_client=httpx2.AsyncClient(transport=transport),
        max_retries=0,
    )


async def test_a_tool_using_agent_runs_through_the_sdk_as_one_session() -> None:
    async with gateway() as (app, core, scheduler):
        sdk = client(app)
        raw = await sdk.chat.completions.with_raw_response.create(
            model=MODEL, messages=QUESTION, tools=TOOLS, stop="never"
        )
        first = raw.parse()
        session = raw.headers["x-libra-session"]
        message = first.choices[0].message
        assert first.choices[0].finish_reason == "tool_calls"
        assert message.role == "assistant" and message.content == "Let me compute."
        [call] = message.tool_calls or []
        assert call.type == "function" and call.function.name == "calculator"
        assert json.loads(call.function.arguments) == {"expression": "6 * 7"}
        assert first.usage is not None and first.usage.completion_tokens > 0
        history = [
            *QUESTION,
            message.model_dump(exclude_unset=True),  # handed back as parsed
            {"role": "tool", "tool_call_id": call.id, "content": "42"},
        ]
        raw = await sdk.chat.completions.with_raw_response.create(
            model=MODEL,
            messages=history,  # type: ignore[arg-type]
            tools=TOOLS,
            max_completion_tokens=64,
        )
        second = raw.parse()
        assert raw.headers["x-libra-session"] == session
        assert second.choices[0].message.content == "It is 42."
        assert second.choices[0].finish_reason == "stop"
        assert len(core) == 1
        await core.report(session, done=True)
    # The tool result reached the scheduler as a signal.
    assert scheduler.paths == {session: ["calculator:small:success"]}


@sdk_stream_generators
async def test_a_streamed_turn_has_role_content_tool_call_deltas_finish_and_usage() -> None:
    async with gateway() as (app, _, _):
        sdk = client(app)
        stream = await sdk.chat.completions.create(
            model=MODEL,
            messages=QUESTION,
            tools=TOOLS,
            stream=True,
            stream_options={"include_usage": True},
        )
        async with stream:
            chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == "Let me compute."
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert deltas[0].id and deltas[0].type == "function" and deltas[0].index == 0
    assert deltas[0].function is not None and deltas[0].function.name == "calculator"
    arguments = "".join(d.function.arguments or "" for d in deltas if d.function)
    assert json.loads(arguments) == {"expression": "6 * 7"}
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "tool_calls" and set(finishes[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.total_tokens > 0
    assert len({c.id for c in chunks}) == 1


@sdk_stream_generators
async def test_the_sdk_stream_helper_accumulates_the_same_message() -> None:
    async with gateway() as (app, _, _):
        sdk = client(app)
        async with sdk.chat.completions.stream(model=MODEL, messages=QUESTION, tools=TOOLS) as s:
            final = await s.get_final_completion()
    message = final.choices[0].message
    assert message.content == "Let me compute."
    assert [c.function.name for c in message.tool_calls or []] == ["calculator"]


async def test_parallel_tool_calls_false_keeps_only_the_first_call() -> None:
    two = "Two. " + CALL + "\n" + CALL
    async with gateway([two]) as (app, _, _):
        reply = await client(app).chat.completions.create(
            model=MODEL, messages=QUESTION, tools=TOOLS, parallel_tool_calls=False
        )
    assert len(reply.choices[0].message.tool_calls or []) == 1


@pytest.mark.parametrize("stream", [False, True])
@sdk_stream_generators
async def test_completions_whole_and_streamed(stream: bool) -> None:
    async with gateway(["Once upon a time"]) as (app, _, _):
        sdk = client(app)
        if stream:
            chunks = [
                c
                async for c in await sdk.completions.create(
                    model=MODEL, prompt="Tell me a story", max_tokens=8, stream=True
                )
            ]
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            finish = chunks[-1].choices[0].finish_reason
        else:
            completion = await sdk.completions.create(
                model=MODEL, prompt="Tell me a story", max_tokens=8, stop=["never"]
            )
            assert completion.model == MODEL and completion.usage is not None
            text, finish = completion.choices[0].text, completion.choices[0].finish_reason
    assert text and finish in ("stop", "length")


async def test_tokenize_and_token_id_completions_give_a_trainer_exact_tokens() -> None:
    async with gateway(["Once upon a time"]) as (app, _, _):
        auth = {"Authorization": f"Bearer {USER_KEY}"}
        async with httpx2.AsyncClient(
            transport=httpx2.ASGITransport(app=app), base_url="http://gateway", headers=auth
        ) as http:
            chat = [{"role": "user", "content": "Tell me a story"}]
            rendered = await http.post("/tokenize", json={"model": MODEL, "messages": chat})
            prompt = rendered.json()["tokens"]
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 8}
            exact = await http.post(
                "/v1/completions", json={**body, "return_token_ids": True, "logprobs": 0}
            )
            plain = await http.post("/v1/completions", json=body)
            top = await http.post("/v1/completions", json={**body, "logprobs": 2})
    assert rendered.status_code == 200 and prompt and rendered.json()["count"] == len(prompt)
    choice = exact.json()["choices"][0]
    assert choice["token_ids"] and len(choice["logprobs"]["token_logprobs"]) == len(
        choice["token_ids"]
    )
    assert all(isinstance(lp, float) for lp in choice["logprobs"]["token_logprobs"])
    # Without asking, the public reply keeps OpenAI's shape: no ids, null logprobs.
    public = plain.json()["choices"][0]
    assert "token_ids" not in public and public["logprobs"] is None
    assert top.status_code == 400 and top.json()["error"]["param"] == "logprobs"


@pytest.mark.parametrize("stream", [False, True])
async def test_a_completion_with_a_session_header_is_a_turn_of_that_session(
    stream: bool,
) -> None:
    async with gateway() as (app, core, scheduler):
        auth = {"Authorization": f"Bearer {USER_KEY}", SESSION_HEADER: "trainer-1"}
        async with httpx2.AsyncClient(
            transport=httpx2.ASGITransport(app=app), base_url="http://gateway", headers=auth
        ) as http:
            body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 8}
            answers = [
                await http.post("/v1/completions", json={**body, "stream": stream})
                for _ in range(2)
            ]
        assert [a.status_code for a in answers] == [200, 200]
        assert all(a.headers[SESSION_HEADER] == "trainer-1" for a in answers)
        assert len(core) == 1 and len(scheduler.tracks) == 1  # one live trajectory


async def test_models_health_and_metrics() -> None:
    async with gateway() as (app, _, _):
        sdk = client(app)
        assert [m.id async for m in sdk.models.list()] == [MODEL]
        await sdk.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS)
        async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app)) as http:
            health = await http.get("http://gateway/health")
            auth = {"Authorization": f"Bearer {USER_KEY}"}
            metrics = (await http.get("http://gateway/metrics", headers=auth)).text
    assert health.status_code == 200
    assert 'libra_gateway_requests_total{route="chat",status="200"} 1.0' in metrics
    assert 'libra_gateway_tokens_total{bucket="all",kind="completion"}' in metrics
    ok = 'libra_gateway_bucket_requests_total{bucket="all",endpoint="emulated",outcome="ok"}'
    assert f"{ok} 1.0" in metrics
    assert 'libra_gateway_upstream_in_flight{bucket="all",endpoint="emulated"} 0.0' in metrics
    assert "libra_gateway_core_seconds_bucket" in metrics
    assert "libra_gateway_promotions_total 0.0" in metrics


# ----------------------------------------------------------------- refused requests


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"frequency_penalty": 0.5}, "frequency_penalty"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"n": 2}, "n"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "calculator"}}}, "tool_choice"),
        ({"logprobs": True}, "logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"made_up_field": 1}, "made_up_field"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        (
            {"messages": [{"role": "user", "content": "x", "surprise": True}]},
            "messages[0].surprise",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": "http://x"}}],
                    }
                ]
            },
            "messages[0].content[0]",
        ),
        ({"messages": [{"role": "tool", "content": "42"}]}, "messages[0].tool_call_id"),
        ({"temperature": "hot"}, "temperature"),
    ],
)
async def test_every_unsupported_or_unknown_field_is_a_400_naming_it(
    fields: dict[str, Any], param: str
) -> None:
    body: dict[str, Any] = {"messages": QUESTION, **fields}
    messages = body.pop("messages")
    async with gateway() as (app, _, _):
        with pytest.raises(openai.BadRequestError) as refused:
            await client(app).chat.completions.create(
                model=MODEL, messages=messages, extra_body=body
            )
    assert refused.value.status_code == 400 and refused.value.param == param
    assert param.split(".")[-1].split("[")[0] in refused.value.message.lower()


async def test_an_unknown_model_is_a_404() -> None:
    async with gateway() as (app, _, _):
        with pytest.raises(openai.NotFoundError) as missing:
            await client(app).chat.completions.create(model="gpt-9", messages=QUESTION)
    assert missing.value.code == "model_not_found"


async def test_an_oversized_body_is_a_413() -> None:
    async with gateway(max_body_bytes=1024) as (app, _, _):
        long = [{"role": "user", "content": "x" * 2000}]
        with pytest.raises(openai.APIStatusError) as refused:
            await client(app).chat.completions.create(model=MODEL, messages=long)  # type: ignore[arg-type]
    assert refused.value.status_code == 413


# ------------------------------------------------------------------------- keys


async def test_requests_need_a_key_and_admin_routes_an_admin_key() -> None:
    async with gateway() as (app, _, _):
        with pytest.raises(openai.AuthenticationError) as refused:
            await client(app, "wrong").models.list()
        assert refused.value.code == "invalid_api_key"
        async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app)) as http:

            async def status(path: str, key: str | None, method: str = "GET") -> int:
                headers = {"Authorization": f"Bearer {key}"} if key else {}
                url = f"http://gateway{path}"
                return (await http.request(method, url, headers=headers)).status_code

            assert await status("/v1/models", None) == 401
            assert await status("/admin/status", None) == 401
            assert await status("/admin/status", USER_KEY) == 403
            assert await status("/admin/status", ADMIN_KEY) == 200
            assert await status("/admin/pause", USER_KEY, "POST") == 403
            assert await status("/metrics", None) == 401
            assert await status("/health", None) == 200
            # The upstream servers' own admin endpoints are not reachable through it.
            for path in ("/pause", "/resume", "/collective_rpc", "/v1/admin/pause"):
                assert await status(path, ADMIN_KEY, "POST") == 404
            # The admin API's answers, refusals too, say what answered (a trainer's probe).
            marked = [
                ADMIN_HEADER in (await http.get(f"http://gateway{path}", headers=auth)).headers
                for path, auth in (
                    ("/admin/status", {}),
                    ("/admin/status", {"Authorization": f"Bearer {ADMIN_KEY}"}),
                    ("/v1/models", {"Authorization": f"Bearer {USER_KEY}"}),
                )
            ]
            assert marked == [True, True, False]


async def test_the_admin_api_pauses_resumes_reports_and_refuses_a_bad_reload(
    tmp_path: Path,
) -> None:
    async with gateway() as (app, core, _):
        auth = {"Authorization": f"Bearer {ADMIN_KEY}"}
        async with httpx2.AsyncClient(
            transport=httpx2.ASGITransport(app=app), base_url="http://gateway", headers=auth
        ) as http:
            assert (await http.post("/admin/pause")).json() == {"paused": True}
            assert (await http.get("/admin/status")).json()["paused"] is True
            assert (await http.post("/admin/resume")).json() == {"paused": False}
            status = (await http.get("/admin/status")).json()
            body = {"path": str(tmp_path), "version": 2}  # no weights file in it
            failed = await http.post("/admin/reload_weights", json=body)
            assert failed.status_code == 502 and "not reloaded" in failed.text
            (tmp_path / WEIGHTS_FILE).write_bytes(b"")
            # The sync reaches the in-process emulated server as the engine does.
            reloaded = await http.post("/admin/reload_weights", json=body)
            assert reloaded.status_code == 200 and reloaded.json()["version"] == 2, reloaded.text
            assert set((await http.get("/admin/status")).json()["versions"].values()) == {2}
            typo = await http.post("/admin/reload_weights", json={"path": "x", "versoin": 2})
            assert typo.status_code == 400 and typo.json()["error"]["param"] == "versoin"
        assert status["paused"] is False and list(status["healthy"].values()) == [True]
        assert core.status().paused is False


async def test_without_admin_keys_the_admin_api_is_closed() -> None:
    auth = {"Authorization": f"Bearer {USER_KEY}"}
    async with (
        gateway(keys=Keys.of([USER_KEY], [])) as (app, _, _),
        httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app)) as http,
    ):
        response = await http.get("http://gateway/admin/status", headers=auth)
    assert response.status_code == 403 and "LIBRA_ADMIN_KEY" in response.text


async def test_with_auth_off_every_route_is_open() -> None:
    async with gateway(keys=Keys.of([], [], enabled=False)) as (app, _, _):
        assert [m.id async for m in client(app, "any").models.list()] == [MODEL]
        async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app)) as http:
            response = await http.get("http://gateway/admin/status")
    assert response.status_code == 200  # loopback without auth (libra serve --no-auth)


async def test_a_user_report_of_an_unknown_session_is_a_404() -> None:
    async with gateway() as (app, _, _):
        sdk = client(app)
        with pytest.raises(openai.NotFoundError):
            await sdk.post("/libra/report", body={"session": "nope", "reward": 1.0}, cast_to=dict)


# -------------------------------------------------------------------- disconnects


async def test_a_client_that_disconnects_cancels_its_turn_upstream() -> None:
    # A turn takes seconds on this emulator; the client leaves after 0.2 s.
    slow = LatencyModel(step_base_s=0.05, step_per_seq_s=0.0, step_per_ctx_token_s=0.0)
    async with gateway(["word " * 200], latency=slow) as (app, core, scheduler):
        body = json.dumps({"model": MODEL, "messages": QUESTION}).encode()
        sent: list[ASGIMessage] = []
        gone = anyio.Event()
        messages = iter([{"type": "http.request", "body": body, "more_body": False}])

        async def receive() -> ASGIMessage:
            message = next(messages, None)
            if message is not None:
                return message
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: ASGIMessage) -> None:
            sent.append(message)

        async def leave() -> None:
            await anyio.sleep(0.2)
            assert sum(scheduler.calls_in_flight().values()) == 1  # generating upstream
            gone.set()

        scope = {
            "type": "http",
            "method": "POST",
            "path": "/v1/chat/completions",
            "headers": [(b"authorization", f"Bearer {USER_KEY}".encode())],
        }
        started = time.monotonic()
        async with anyio.create_task_group() as group:
            group.start_soon(leave)
            await app(scope, receive, send)
        assert time.monotonic() - started < 2.0  # not the turn's whole ten seconds
        assert sent == []  # nobody to answer
        assert scheduler.calls_in_flight() == {"emulated": 0}
        assert len(core) == 0  # the session it would have started is not kept
    metrics = app.metrics.exposition().decode()
    assert 'libra_gateway_disconnects_total{route="chat"} 1.0' in metrics


# ------------------------------------------------------- an agent framework's client


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # pydantic-ai needs asyncio's loop
async def test_a_pydantic_ai_agent_with_a_tool_runs_through_the_gateway() -> None:
    # A second real client: pydantic-ai's own OpenAI chat model, as its users run it.
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    async with gateway() as (app, core, scheduler):
        provider = OpenAIProvider(
            base_url="http://gateway/v1",
            api_key=USER_KEY,
            http_client=httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app)),
        )
        agent = Agent(OpenAIChatModel(MODEL, provider=provider), instructions="Be careful.")
        expressions: list[str] = []

        @agent.tool_plain
        def calculator(expression: str) -> str:
            """Evaluate an arithmetic expression."""
            expressions.append(expression)
            return "42"

        result = await agent.run("What is 6 times 7?")
        assert result.output == "It is 42."
        assert expressions == ["6 * 7"]
        assert len(core) == 1  # both turns were one session
        [session] = [key for key in scheduler.tracks]
        await core.report(session, done=True)
    assert scheduler.paths == {session: ["calculator:small:success"]}


# ---------------------------------------------------------------- real vLLM (slow)


@pytest.mark.slow
@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # one server, one backend is enough
async def test_the_sdk_through_the_gateway_to_real_vllm(real_server: VLLMServer) -> None:
    endpoint = Endpoint(real_server.url, model=REAL_MODEL_NAME)
    async with http_transport() as http:
        engine = Engine(http, LeastLoadedScheduler([endpoint]), config=EngineConfig())
        async with Sessions(engine, GatewayConfig()) as core:
            sdk = client(create_gateway(core, KEYS))
            ask: dict[str, Any] = {
                "model": REAL_MODEL_NAME,
                "messages": QUESTION,
                "tools": TOOLS,
                "temperature": 0.0,
                "max_completion_tokens": 32,
            }
            reply = await sdk.chat.completions.create(**ask)
            async with await sdk.chat.completions.create(**ask, stream=True) as stream:
                chunks = [chunk async for chunk in stream]
    choice = reply.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert choice.message.content or choice.message.tool_calls
    assert reply.usage is not None and 0 < reply.usage.completion_tokens <= 32
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == (choice.message.content or "")  # greedy: the same turn
    assert chunks[-1].choices[0].finish_reason == choice.finish_reason
