"""The emulated vLLM server's endpoints, in-process through httpx.ASGITransport."""

from __future__ import annotations

import gc
import json
import re
import weakref
from collections.abc import Mapping

import anyio
import httpx
import msgspec
import pytest

from libra.emulation import (
    EOS_ID,
    EmulatedServerDied,
    EmulatorConfig,
    LatencyModel,
    ScriptedReplies,
    create_app,
    emulator_process,
    render_chat,
)
from libra.engine import ASGITransport, TransportError
from libra.openai import (
    ChatCompletion,
    Completion,
    DetokenizeResponse,
    ErrorResponse,
    TokenizeResponse,
)
from tests._helpers import CALCULATOR, LOOKUP, QUESTION, chat, complete, emulator

pytestmark = pytest.mark.anyio

MODEL = "libra-emulated"
TOOL_CALL = (
    '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 * 7 + 3"}}\n</tool_call>'
)


async def error(response: httpx.Response, status: int) -> str:
    assert response.status_code == status, response.text
    body = msgspec.json.decode(response.content, type=ErrorResponse)
    assert body.error.code == status
    return body.error.message


# ------------------------------------------------------------------------- simple GETs


async def test_health_models_and_metrics() -> None:
    async with emulator(model_name="tiny", max_model_len=4096) as client:
        assert (await client.get("/health")).status_code == 200
        models = (await client.get("/v1/models")).json()
        assert models["object"] == "list"
        assert [(m["id"], m["max_model_len"]) for m in models["data"]] == [("tiny", 4096)]
        metrics = await client.get("/metrics")
        assert metrics.headers["content-type"].startswith("text/plain")
        for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
            assert f'vllm:{name}{{model_name="tiny"}} 0.0' in metrics.text
        assert 'vllm:num_preemptions_total{model_name="tiny"} 0.0' in metrics.text


# ------------------------------------------------------------------- chat completions


async def test_chat_completion_shape_without_extras() -> None:
    async with emulator(ScriptedReplies(["The answer is 87."])) as client:
        completion = await chat(client)
    assert completion.object == "chat.completion" and completion.model == MODEL
    assert completion.id.startswith("chatcmpl-") and completion.prompt_token_ids is None
    (choice,) = completion.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == "The answer is 87."
    assert choice.finish_reason == "stop"
    assert choice.token_ids is None and choice.logprobs is None
    assert completion.usage is not None
    assert completion.usage.completion_tokens == len("The answer is 87.") + 1  # + EOS
    prompt_tokens = len(render_chat(QUESTION, add_generation_prompt=True))
    assert completion.usage.prompt_tokens == prompt_tokens
    assert completion.usage.total_tokens == prompt_tokens + completion.usage.completion_tokens


async def test_chat_token_ids_and_logprobs_agree() -> None:
    async with emulator(ScriptedReplies(["The answer is 87."])) as client:
        completion = await chat(client, return_token_ids=True, logprobs=True)
        tokenized = await client.post(
            "/tokenize", json={"model": MODEL, "messages": QUESTION, "add_generation_prompt": True}
        )
    (choice,) = completion.choices
    assert completion.prompt_token_ids == tokenized.json()["tokens"]
    assert choice.token_ids == [*b"The answer is 87.", EOS_ID]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    assert len(choice.logprobs.content) == len(choice.token_ids)
    assert all(entry.logprob < 0 for entry in choice.logprobs.content)
    assert choice.logprobs.content[-1].token == "<|im_end|>"
    assert completion.usage is not None
    assert completion.usage.completion_tokens == len(choice.token_ids)


async def test_chat_parses_hermes_tool_calls() -> None:
    second = '<tool_call>\n{"name": "lookup", "arguments": {"id": 3}}\n</tool_call>'
    reply = f"Let me compute.\n{TOOL_CALL}\n{second}"
    async with emulator(ScriptedReplies([reply])) as client:
        completion = await chat(client, tools=[CALCULATOR, LOOKUP], return_token_ids=True)
    (choice,) = completion.choices
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me compute.\n"
    calls = choice.message.tool_calls or []
    assert [call.function.name for call in calls] == ["calculator", "lookup"]
    assert json.loads(calls[0].function.arguments) == {"expression": "12 * 7 + 3"}
    assert json.loads(calls[1].function.arguments) == {"id": 3}
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", call.id) for call in calls)
    assert len({call.id for call in calls}) == 2
    assert choice.token_ids is not None
    assert bytes(choice.token_ids[:-1]).decode() == reply and choice.token_ids[-1] == EOS_ID


async def test_tool_call_type_is_on_the_wire() -> None:
    async with emulator(ScriptedReplies([TOOL_CALL])) as client:
        body = {"model": MODEL, "messages": QUESTION, "tools": [CALCULATOR]}
        response = await client.post("/v1/chat/completions", json=body)
    (call,) = response.json()["choices"][0]["message"]["tool_calls"]
    assert call["type"] == "function"
    assert response.json()["choices"][0]["message"].get("content") is None


@pytest.mark.parametrize(
    "reply",
    [
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": \n</tool_call>',
        '<tool_call>\n{"arguments": {}}\n</tool_call>',
        "<tool_call>\n[1, 2]\n</tool_call>",
    ],
)
async def test_unparseable_tool_calls_stay_in_content(reply: str) -> None:
    async with emulator(ScriptedReplies([reply])) as client:
        completion = await chat(client, tools=[CALCULATOR])
    (choice,) = completion.choices
    assert (choice.message.content, choice.message.tool_calls) == (reply, None)
    assert choice.finish_reason == "stop"


async def test_tool_calls_are_not_parsed_without_tools_in_the_request() -> None:
    async with emulator(ScriptedReplies([TOOL_CALL])) as client:
        completion = await chat(client)
    assert completion.choices[0].message.content == TOOL_CALL
    assert completion.choices[0].message.tool_calls is None


async def test_max_tokens_truncates_without_eos() -> None:
    async with emulator(ScriptedReplies(["The answer is 87."])) as client:
        completion = await chat(client, max_tokens=5, return_token_ids=True, logprobs=True)
    (choice,) = completion.choices
    assert choice.finish_reason == "length"
    assert choice.token_ids == list(b"The a") and choice.message.content == "The a"
    assert choice.logprobs is not None and len(choice.logprobs.content or []) == 5


async def test_max_tokens_equal_to_reply_plus_eos_stops_normally() -> None:
    async with emulator(ScriptedReplies(["abc"])) as client:
        completion = await chat(client, max_tokens=4, return_token_ids=True)
    assert completion.choices[0].finish_reason == "stop"
    assert completion.choices[0].token_ids == [*b"abc", EOS_ID]


async def test_stop_strings_cut_the_reply_like_vllm() -> None:
    # vLLM keeps the stop string's tokens, not its text (unless asked), and names it.
    async with emulator(ScriptedReplies(["one two three"] * 2)) as client:
        completion = await chat(client, stop=[" three", " two"], return_token_ids=True)
        included = await chat(client, stop=[" two"], include_stop_str_in_output=True)
    (choice,) = completion.choices
    assert (choice.message.content, choice.finish_reason) == ("one", "stop")
    assert (choice.token_ids, choice.stop_reason) == (list(b"one two"), " two")
    assert included.choices[0].message.content == "one two"


async def test_scripted_replies_follow_the_turn_number() -> None:
    async with emulator(ScriptedReplies(["first", "second"])) as client:
        first = await chat(client)
        history = [*QUESTION, {"role": "assistant", "content": "first"}]
        history.append({"role": "user", "content": "and?"})
        second = await chat(client, messages=history)
        history += [{"role": "assistant", "content": "second"}, {"role": "user", "content": "?"}]
        response = await client.post(
            "/v1/chat/completions", json={"model": MODEL, "messages": history}
        )
    assert first.choices[0].message.content == "first"
    assert second.choices[0].message.content == "second"
    assert "ScriptedReplies has 2 replies" in await error(response, 500)


# ------------------------------------------------------------------------ completions


async def test_completion_with_token_prompt() -> None:
    prompt = render_chat(QUESTION, [CALCULATOR], add_generation_prompt=True)
    async with emulator(ScriptedReplies([TOOL_CALL])) as client:
        completion = await complete(client, prompt=prompt, return_token_ids=True, logprobs=0)
    assert completion.object == "text_completion" and completion.id.startswith("cmpl-")
    (choice,) = completion.choices
    assert choice.text == TOOL_CALL  # raw text: tool calls are not parsed, EOS not shown
    assert choice.token_ids == [*TOOL_CALL.encode(), EOS_ID]
    assert choice.prompt_token_ids == prompt
    assert choice.finish_reason == "stop"
    assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
    assert len(choice.logprobs.token_logprobs) == len(choice.token_ids)
    assert all(lp is not None and lp < 0 for lp in choice.logprobs.token_logprobs)
    assert completion.usage is not None and completion.usage.prompt_tokens == len(prompt)


async def test_completion_with_string_prompt_and_special_tokens_kept() -> None:
    async with emulator(ScriptedReplies(["hi"])) as client:
        kept = await complete(client, prompt="Say hi.", skip_special_tokens=False)
        plain = await complete(client, prompt="Say hi.", return_token_ids=True)
    assert kept.choices[0].text == "hi<|im_end|>"
    assert plain.choices[0].text == "hi"
    assert plain.choices[0].prompt_token_ids == list(b"Say hi.")
    assert plain.choices[0].logprobs is None


async def test_completion_counts_turns_from_the_chatml_prompt() -> None:
    messages = [
        *QUESTION,
        {"role": "assistant", "content": "first"},
        {"role": "user", "content": "?"},
    ]
    prompt = render_chat(messages, add_generation_prompt=True)
    async with emulator(ScriptedReplies(["first", "second"])) as client:
        completion = await complete(client, prompt=prompt, max_tokens=100)
    assert completion.choices[0].text == "second"


# ----------------------------------------------------------------------- tokenizer API


async def test_tokenize_and_detokenize() -> None:
    async with emulator(max_model_len=2048) as client:
        by_prompt = await client.post("/tokenize", json={"model": MODEL, "prompt": "héllo"})
        by_messages = await client.post(
            "/tokenize",
            json={"model": MODEL, "messages": QUESTION, "tools": [CALCULATOR]},
        )
        without_prompt = await client.post(
            "/tokenize",
            json={"model": MODEL, "messages": QUESTION, "add_generation_prompt": False},
        )
        detokenized = await client.post(
            "/detokenize", json={"model": MODEL, "tokens": [257, *b"hi", 258]}
        )
    tokens = msgspec.json.decode(by_prompt.content, type=TokenizeResponse)
    assert tokens == TokenizeResponse(tokens=list("héllo".encode()), count=6, max_model_len=2048)
    chat_tokens = msgspec.json.decode(by_messages.content, type=TokenizeResponse)
    assert chat_tokens.tokens == render_chat(QUESTION, [CALCULATOR], add_generation_prompt=True)
    assert without_prompt.json()["tokens"] == render_chat(QUESTION)
    text = msgspec.json.decode(detokenized.content, type=DetokenizeResponse)
    assert text.prompt == "<|im_start|>hi<|im_end|>"


# ------------------------------------------------------------------------------ errors


async def test_request_errors_look_like_vllm() -> None:
    async with emulator(max_model_len=64) as client:
        post = client.post
        assert "Invalid request" in await error(
            await post("/v1/chat/completions", content=b"{not json"), 400
        )
        assert "messages" in await error(
            await post("/v1/chat/completions", json={"model": MODEL}), 400
        )
        assert "$.max_tokens" in await error(
            await post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": "9"}),
            400,
        )
        await error(await client.get("/v1/nothing"), 404)
        await error(await client.get("/v1/chat/completions"), 405)
        assert "does not exist" in await error(
            await post("/v1/completions", json={"model": "other", "prompt": "x"}), 404
        )
        too_long = {"model": MODEL, "prompt": "x" * 64}
        assert "maximum context length is 64" in await error(
            await post("/v1/completions", json=too_long), 400
        )
        no_room = {"model": MODEL, "prompt": "x" * 10, "max_tokens": 60}
        assert "60 in the completion" in await error(
            await post("/v1/completions", json=no_room), 400
        )
        bad: Mapping[str, object]
        for bad in ({"max_tokens": 0}, {"prompt": [1, 999]}, {"prompt": []}, {"logprobs": 21}):
            await error(
                await post("/v1/completions", json={"model": MODEL, "prompt": "x", **bad}), 400
            )
        assert "Streaming" in await error(
            await post(
                "/v1/chat/completions", json={"model": MODEL, "messages": [], "stream": True}
            ),
            400,
        )
        await error(await post("/tokenize", json={"model": MODEL}), 400)
        await error(await post("/detokenize", json={"model": MODEL, "tokens": [300]}), 400)


async def test_model_name_check_can_be_turned_off() -> None:
    async with emulator(check_model_name=False) as client:
        response = await client.post("/v1/completions", json={"model": "any", "prompt": "x"})
    assert response.status_code == 200


async def test_error_rate_injects_http_500s() -> None:
    async with emulator(error_rate=1.0) as client:
        message = await error(
            await client.post("/v1/completions", json={"model": MODEL, "prompt": "x"}), 500
        )
        assert "Injected failure" in message
        assert (
            await client.post("/tokenize", json={"model": MODEL, "prompt": "x"})
        ).status_code == 200
    async with emulator(error_rate=0.3, seed=4) as client:
        statuses = [
            (await client.post("/v1/completions", json={"model": MODEL, "prompt": "x"})).status_code
            for _ in range(200)
        ]
    assert 30 < statuses.count(500) < 90 and statuses.count(200) + statuses.count(500) == 200


async def test_a_weight_sync_s_dev_mode_routes_answer_like_vllm() -> None:
    async with emulator() as client:
        rpc = {"method": "reload_weights", "kwargs": {"weights_path": "/nowhere"}}
        reloaded = await client.post("/collective_rpc", json=rpc)
        assert reloaded.status_code == 200, reloaded.text
        reset = await client.post("/reset_prefix_cache", params={"reset_running_requests": "true"})
        assert reset.status_code == 200 and reset.json() == {"success": True}
        other = await client.post("/collective_rpc", json={"method": "sleep"})
        assert "sleep" in await error(other, 400)


# ---------------------------------------------------------------------- injected faults

COMPLETION = {"model": MODEL, "prompt": "x", "max_tokens": 20}


async def test_no_fault_at_rate_zero() -> None:
    async with emulator(stall_rate=0.0, abort_rate=0.0, garbage_rate=0.0, die_rate=0.0) as client:
        for _ in range(20):
            completion = await chat(client, tools=[CALCULATOR])
            assert completion.choices[0].finish_reason in ("stop", "tool_calls")


async def test_stall_rate_never_answers_until_the_client_gives_up() -> None:
    async with emulator(stall_rate=1.0) as client:
        with anyio.move_on_after(0.3) as waited:
            await client.post("/v1/completions", json=COMPLETION)
        assert waited.cancelled_caught
        assert (await client.get("/health")).status_code == 200


async def test_abort_rate_ends_requests_early_with_a_partial_output() -> None:
    reply = "a reply long enough to be cut somewhere in its middle"
    async with emulator(ScriptedReplies([reply]), abort_rate=1.0) as client:
        for request_seed in range(5):
            completion = await chat(client, tools=[CALCULATOR], seed=request_seed)
            (choice,) = completion.choices
            assert choice.finish_reason == "abort" and not choice.message.tool_calls
            assert reply.startswith(choice.message.content or "")
            assert len(choice.message.content or "") < len(reply)


async def test_garbage_rate_answers_200_with_no_openai_response() -> None:
    async with emulator(garbage_rate=1.0) as client:
        for _ in range(6):
            body = {"model": MODEL, "messages": QUESTION}
            response = await client.post("/v1/chat/completions", json=body)
            assert response.status_code == 200
            with pytest.raises(msgspec.DecodeError):  # invalid JSON, or not a completion
                msgspec.json.decode(response.content, type=ChatCompletion)


async def test_fault_rates_are_reproducible_for_a_seed() -> None:
    runs = []
    for _ in range(2):
        async with emulator(abort_rate=0.3, garbage_rate=0.3, seed=5) as client:
            responses = [await client.post("/v1/completions", json=COMPLETION) for _ in range(30)]
            runs.append([outcome(response) for response in responses])
    assert runs[0] == runs[1]
    assert {"stop", "length", "abort", "garbage"} >= set(runs[0]) >= {"abort", "garbage"}


def outcome(response: httpx.Response) -> str:
    """The finish reason of a completion, or "garbage" for a body that is none."""
    try:
        completion = msgspec.json.decode(response.content, type=Completion)
    except msgspec.DecodeError:
        return "garbage"
    return completion.choices[0].finish_reason or "none"


def test_fault_rates_must_fit_in_one_draw() -> None:
    with pytest.raises(ValueError, match="add up"):
        EmulatorConfig(error_rate=0.6, abort_rate=0.6)


async def test_an_in_process_server_that_died_fails_every_call_like_a_lost_connection() -> None:
    app = create_app(EmulatorConfig(die_after=1, latency=LatencyModel.zero()))
    body = msgspec.json.encode(COMPLETION)
    url = "http://emulated/v1/completions"
    async with ASGITransport(app) as transport:
        status, _ = await transport.post(url, body, {}, 5.0)
        assert status == 200
        for _ in range(2):
            with pytest.raises(TransportError, match="died"):
                await transport.post(url, body, {}, 5.0)
        with pytest.raises(TransportError):
            await transport.get("http://emulated/health", 5.0)
    async with emulator(die_rate=1.0) as client:
        with pytest.raises(EmulatedServerDied):
            await client.post("/v1/completions", json=COMPLETION)


async def test_a_dropped_server_is_freed_at_once_without_the_cycle_collector() -> None:
    """A fleet drops a dead server's app on restart: no reference cycle may keep it (and
    its caches) until a full collection, which a long run may not do for a long time."""
    app = create_app(EmulatorConfig(die_after=2, latency=LatencyModel(), seed=3))
    body = msgspec.json.encode(COMPLETION)
    gc.disable()
    try:
        async with ASGITransport(app) as transport:
            for _ in range(2):
                status, _ = await transport.post("http://emulated/v1/completions", body, {}, 5.0)
                assert status == 200
            with pytest.raises(TransportError, match="died"):
                await transport.post("http://emulated/v1/completions", body, {}, 5.0)
        dropped = weakref.ref(app)
        del app, transport
        assert dropped() is None
    finally:
        gc.enable()


def test_a_served_emulator_exits_when_it_dies() -> None:
    config = EmulatorConfig(die_after=1, latency=LatencyModel.zero())
    with emulator_process(config) as server, httpx.Client(base_url=server.url) as client:
        assert client.post("/v1/completions", json=COMPLETION).status_code == 200
        with pytest.raises(httpx.TransportError):
            client.post("/v1/completions", json=COMPLETION)
        assert server.process.wait(timeout=10) == 1
