"""The gateway's core against the emulated server: sessions found by prefix and by key,
tool results turned into scheduler signals, edited history, idle expiry, recording,
failures, pause and weight reloads."""

from __future__ import annotations

import json
import socket
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import httpx
import msgspec
import pytest

from libra.emulation import AgentScript, EmulatorConfig, LatencyModel, running_emulator
from libra.engine import (
    Engine,
    EngineConfig,
    RequestRejected,
    ServerUnavailable,
    TrajectoryRecord,
    http_transport,
)
from libra.fleet import Api, Endpoint
from libra.gateway import ChatReply, ChatTurn, FleetStatus, GatewayConfig, GatewayCore, Sessions
from libra.openai import CompletionRequest, Message
from libra.sched import Router
from libra.sched.policies import CMLFQ, RoundRobin
from libra.serving import WEIGHTS_FILE
from tests._helpers import (
    CALCULATOR,
    EMULATED_URL,
    MODEL,
    PathRecorder,
    assert_tokens_consistent,
    emulated_engine,
    sampled_spans,
    tokenizer,
)

pytestmark = pytest.mark.anyio


def call(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


QUESTION = [
    Message(role="system", content="You are careful."),
    Message(role="user", content="What is 6 times 7?"),
]
REPLIES = ["Let me compute. " + call("calculator", '{"expression": "6 * 7"}'), "It is 42."]


def echoed(reply: ChatReply) -> Message:
    """The reply as an OpenAI client sends it back in its next request."""
    return Message(role="assistant", content=reply.content, tool_calls=reply.tool_calls or None)


def tool_result(reply: ChatReply, content: str) -> Message:
    return Message(role="tool", content=content, tool_call_id=reply.tool_calls[0].id)


async def agent(core: GatewayCore, key: str | None = None) -> list[ChatReply]:
    """A two-turn agent: asks, runs the tool it is told to, asks again."""
    first = await core.chat(ChatTurn(list(QUESTION), tools=[CALCULATOR], session=key))
    history = [*QUESTION, echoed(first), tool_result(first, "42")]
    second = await core.chat(ChatTurn(history, tools=[CALCULATOR], session=key))
    return [first, second]


@pytest.mark.parametrize("key", [None, "agent-7"])
async def test_a_tool_using_agent_is_one_session_by_prefix_or_by_key(key: str | None) -> None:
    scheduler = PathRecorder()
    async with (
        emulated_engine(REPLIES, scheduler=scheduler) as (engine, records),
        Sessions(engine) as core,
    ):
        first, second = await agent(core, key)
        assert first.session == second.session == (key or first.session)
        assert first.finish_reason == "tool_calls" and first.content == "Let me compute."
        assert [c.function.name for c in first.tool_calls] == ["calculator"]
        assert json.loads(first.tool_calls[0].function.arguments) == {"expression": "6 * 7"}
        assert (second.finish_reason, second.content) == ("stop", "It is 42.")
        assert second.tool_calls == []
        assert len(core) == 1
        await core.report(second.session, reward=1.0, done=True)
        assert len(core) == 0
    [record] = records
    assert (record.status, record.stop_reason, record.reward, record.turns) == (
        "completed",
        "done",
        1.0,
        2,
    )
    assert [r.tool for r in record.tool_returns] == ["calculator"]
    assert record.tokens == "exact" and record.weight_versions
    assert_tokens_consistent(record, [CALCULATOR])
    assert sampled_spans(record) == [[*tokenizer.encode(r), 258] for r in REPLIES]
    # The scheduler was told of the tool result, and forgot the session at its end.
    assert scheduler.paths == {record.id: ["calculator:small:success"]}


@pytest.mark.parametrize("api", ["auto", "chat"])
async def test_tool_calls_come_back_split_out_when_the_template_has_no_tools(api: Api) -> None:
    # SmolLM2's template drops ``tools``: they are described in the system message, and
    # the <tool_call> block the model writes reaches the client as OpenAI tool_calls.
    async with (
        emulated_engine(REPLIES, api=api, template_renders_tools=False) as (engine, records),
        Sessions(engine) as core,
    ):
        first, second = await agent(core)
        assert first.session == second.session
        assert first.finish_reason == "tool_calls" and first.content == "Let me compute."
        assert json.loads(first.tool_calls[0].function.arguments) == {"expression": "6 * 7"}
        assert second.content == "It is 42."
    [record] = records
    system = record.messages[0].content or ""
    assert system.startswith("You are careful.") and "<tools>" in system
    assert record.turns == 2 and [r.tool for r in record.tool_returns] == ["calculator"]
    assert (record.status, record.stop_reason) == ("truncated", "shutdown")  # live at the end
    if api == "auto":
        assert record.tokens == "exact"
        assert_tokens_consistent(record, tools=[])


async def test_tool_results_reach_c_mlfq_and_an_expired_session_leaves_no_state() -> None:
    router = Router.over([Endpoint(EMULATED_URL, model=MODEL)])
    policy = CMLFQ(router)
    config = GatewayConfig(session_ttl_s=0.5, sweep_every_s=0.05)
    async with (
        emulated_engine(scheduler=policy) as (engine, records),
        Sessions(engine, config) as core,
    ):
        tool_users = 0
        for n in range(20):
            key = f"agent-{n}" if n % 2 else None  # keyed and unkeyed ones
            history = [Message(role="user", content=f"Add {n} and 1")]
            first = await core.chat(ChatTurn(history, tools=[CALCULATOR], session=key))
            if first.tool_calls:
                tool_users += 1
                history += [echoed(first), tool_result(first, "Error: division by zero")]
                await core.chat(ChatTurn(history, tools=[CALCULATOR], session=key))
        assert len(core) == 20 and len(policy.tracks) == 20
        paths = [track.path for track in policy.tracks.values() if track.path]
        assert tool_users > 0 and paths == [["calculator:small:failure"]] * tool_users
        await anyio.sleep(1.5)  # three TTLs: the background sweep ended every one
        assert len(core) == core.indexed == 0
        assert policy.tracks == {} and router.home == {}
    assert len(records) == 20 and {r.stop_reason for r in records} == {"idle_ttl"}
    assert sum(len(r.tool_returns) for r in records) == tool_users


async def test_identical_conversations_stay_apart_and_an_echoed_id_is_a_key() -> None:
    async with (
        emulated_engine([*REPLIES, "You are welcome."]) as (engine, records),
        Sessions(engine) as core,
    ):
        # Two agents ask the same and get the same reply: each follow-up takes one.
        firsts = [await core.chat(ChatTurn(list(QUESTION), tools=[CALCULATOR])) for _ in "ab"]
        assert firsts[0].session != firsts[1].session
        results = zip(firsts, ["42", "41"], strict=True)
        histories = [[*QUESTION, echoed(f), tool_result(f, r)] for f, r in results]
        seconds = [await core.chat(ChatTurn(h, tools=[CALCULATOR])) for h in histories]
        assert {r.session for r in seconds} == {f.session for f in firsts}
        # The id the gateway answered with, sent back as the session key, names it.
        history = [*histories[0], echoed(seconds[0]), Message(role="user", content="Thanks")]
        third = await core.chat(ChatTurn(history, session=seconds[0].session))
        assert third.session == seconds[0].session and len(core) == 2
    assert sorted(r.turns for r in records) == [2, 3]
    assert all(len(r.tool_returns) == 1 for r in records)


async def test_edited_history_ends_the_keyed_session_and_starts_another() -> None:
    replies = ["Hello.", "Hello again."]
    async with emulated_engine(replies) as (engine, records), Sessions(engine) as core:
        first = await core.chat(ChatTurn(list(QUESTION), session="k"))
        edited = Message(role="assistant", content="Something I never said.")
        again = await core.chat(ChatTurn([*QUESTION, edited, QUESTION[1]], session="k"))
        assert again.session == "k" and len(core) == 1
        [ended] = records
        assert (ended.status, ended.stop_reason, ended.turns) == ("completed", "history_edited", 1)
        # Without a key, an edited history simply matches no session: a new one starts.
        forked = await core.chat(ChatTurn([*QUESTION, edited, QUESTION[1]]))
        assert forked.session not in ("k", first.session) and len(core) == 2


async def test_a_client_that_goes_away_leaves_the_session_as_it_was() -> None:
    async with (
        emulated_engine(REPLIES) as (engine, records),
        Sessions(engine) as core,
    ):
        first = await core.chat(ChatTurn(list(QUESTION), tools=[CALCULATOR]))
        history = [*QUESTION, echoed(first), tool_result(first, "42")]
        await core.pause()  # the next turn waits at the core, where it is cancelled
        with anyio.move_on_after(0.05):
            await core.chat(ChatTurn(history, tools=[CALCULATOR]))
        assert core.status().paused
        await core.resume()
        second = await core.chat(ChatTurn(history, tools=[CALCULATOR]))
        assert second.session == first.session and second.content == "It is 42."
        await core.report(first.session, done=True)
    [record] = records
    assert [m.role for m in record.messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert len(record.tool_returns) == 1
    assert_tokens_consistent(record, [CALCULATOR])


async def test_requests_of_one_keyed_session_take_turns() -> None:
    async with emulated_engine(["One.", "Two."]) as (engine, records), Sessions(engine) as core:
        first = await core.chat(ChatTurn(list(QUESTION), session="k"))
        follow_up = [*QUESTION, echoed(first), Message(role="user", content="And?")]
        replies: list[ChatReply] = []
        await core.pause()
        async with anyio.create_task_group() as group:
            for _ in range(2):
                group.start_soon(lambda: _append(core, follow_up, replies))
            await anyio.sleep(0.02)
            await core.resume()
        # The second request found its session one reply further, with history it
        # lacks: edited, so it went on in a new session (its second turn again).
        assert [r.content for r in replies] == ["Two.", "Two."]
        assert replies[0].session == replies[1].session == "k"
        await core.report("k", done=True)
    assert [(r.stop_reason, r.turns) for r in records] == [("history_edited", 2), ("done", 1)]


async def _append(core: GatewayCore, messages: list[Message], into: list[ChatReply]) -> None:
    into.append(await core.chat(ChatTurn(messages, session="k")))


async def test_recording_writes_jsonl_and_streams_without_blocking(tmp_path: Path) -> None:
    path = tmp_path / "sessions.jsonl"
    config = GatewayConfig(record_path=path, record_stream=True, record_buffer=2)
    async with emulated_engine() as (engine, _), Sessions(engine, config) as core:
        for n in range(3):
            reply = await core.chat(ChatTurn([Message(role="user", content=f"Say {n}")]))
            await core.report(reply.session, reward=float(n), done=True)
        assert core.recorder.dropped == 1  # nobody read: the oldest went
    streamed = [record async for record in core.records()]  # closed: what it holds
    lines = path.read_bytes().splitlines()
    written = [msgspec.json.decode(line, type=TrajectoryRecord) for line in lines]
    assert [r.reward for r in written] == [0.0, 1.0, 2.0]
    assert [r.id for r in streamed] == [r.id for r in written[1:]]
    for record in written:
        assert record.status == "completed" and record.tokens == "exact"
        assert record.weight_versions and record.weight_version == 0
        assert_tokens_consistent(record, [])


async def test_every_session_ended_is_forgotten_and_recorded_once() -> None:
    config = GatewayConfig(max_sessions=3)
    async with emulated_engine() as (engine, records), Sessions(engine, config) as core:
        for n in range(5):
            await core.chat(ChatTurn([Message(role="user", content=f"Say {n}")]))
        assert len(core) == 3
        assert [r.stop_reason for r in records] == ["evicted", "evicted"]
        with pytest.raises(KeyError):
            await core.report("s1-unknown", done=True)
    assert len(records) == 5 and len({r.id for r in records}) == 5


async def test_invalid_sampling_is_refused_before_a_session_starts() -> None:
    async with emulated_engine() as (engine, records), Sessions(engine) as core:
        with pytest.raises(RequestRejected):
            await core.chat(ChatTurn(list(QUESTION), temperature=-1.0))
        assert len(core) == 0
    assert records == []


async def test_stateless_completions_are_routed_and_leave_no_state() -> None:
    router = Router.over([Endpoint(EMULATED_URL, model=MODEL)])
    policy = CMLFQ(router)
    async with emulated_engine(scheduler=policy) as (engine, _), Sessions(engine) as core:
        assert core.models() == [MODEL]
        request = CompletionRequest(model=MODEL, prompt="Once upon a time", max_tokens=8)
        completion = await core.complete(request)
        assert completion.choices and completion.choices[0].text
        assert policy.tracks == {} and router.home == {}
        assert core.status() == FleetStatus({EMULATED_URL: 0}, {EMULATED_URL: True}, False)


@pytest.mark.parametrize("ended_by", ["report", "idle"])
async def test_keyed_completions_are_one_trajectory_to_c_mlfq_until_it_ends(
    ended_by: str,
) -> None:
    """A token-level client's turns under one key: the scheduler sees one trajectory
    with its turns, its tokens and its tool reports, and forgets it once it ends."""
    router = Router.over([Endpoint(EMULATED_URL, model=MODEL)])
    policy = CMLFQ(router)
    config = GatewayConfig(session_ttl_s=0.5, sweep_every_s=0.05)
    async with emulated_engine(scheduler=policy) as (engine, _), Sessions(engine, config) as core:
        prompt = list(b"Once upon a time")
        sampled = 0
        for _ in range(3):
            request = CompletionRequest(model=MODEL, prompt=prompt, max_tokens=8)
            usage = (await core.complete(request, "trainer-7")).usage
            assert usage is not None
            sampled += usage.completion_tokens
            prompt = [*prompt, *b" and then"]
        await core.report("trainer-7", tool=("calculator", "failure"))
        (track,) = policy.tracks.values()
        assert (track.turn, track.generated, len(track.path)) == (2, sampled, 1)
        assert track.instance is not None and len(core) == 1
        await core.complete(CompletionRequest(model=MODEL, prompt="Hi", max_tokens=4))
        assert len(policy.tracks) == 1  # a one-off call is no one's turn
        if ended_by == "report":
            await core.report("trainer-7", done=True)
        else:
            await anyio.sleep(1.0)  # two TTLs: the sweep ended it
        assert policy.tracks == {} and len(core) == 0
        with pytest.raises(KeyError):
            await core.report("trainer-7", done=True)


# ------------------------------------------------------------- a real loopback fleet


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def loopback() -> Iterator[str]:
    with running_emulator(EmulatorConfig(latency=LatencyModel.zero())) as url:
        yield url


@pytest.fixture(scope="module")
def failing() -> Iterator[str]:
    with running_emulator(EmulatorConfig(latency=LatencyModel.zero(), error_rate=1.0)) as url:
        yield url


@pytest.fixture(scope="module")
def tool_user() -> Iterator[str]:
    """A server whose model calls a tool on its first turn and answers on its second."""
    script = AgentScript(tool_call_probability=1.0, max_tool_turns=1)
    with running_emulator(EmulatorConfig(latency=LatencyModel.zero(), agent=script)) as url:
        yield url


@asynccontextmanager
async def loopback_core(
    *urls: str,
    policy: type[RoundRobin] | type[CMLFQ] = RoundRobin,
    config: GatewayConfig | None = None,
) -> AsyncIterator[tuple[Sessions, list[TrajectoryRecord]]]:
    endpoints = [Endpoint(url, model=MODEL, name=f"e{i}") for i, url in enumerate(urls)]
    records: list[TrajectoryRecord] = []
    engine_config = EngineConfig(max_attempts=2, retry_backoff_s=0.01, capacity_wait_s=0)
    async with http_transport("httpx") as http:
        engine = Engine(
            http, policy(Router.over(endpoints)), config=engine_config, on_record=records.append
        )
        async with Sessions(engine, config) as core:
            yield core, records


@pytest.mark.parametrize("key", [None, "agent-7"])
async def test_a_tool_using_agent_over_a_real_port(tool_user: str, key: str | None) -> None:
    async with loopback_core(tool_user, policy=CMLFQ) as (core, records):
        first, second = await agent(core, key)
        assert first.session == second.session and first.finish_reason == "tool_calls"
        assert second.content == "The answer is 42." and second.tool_calls == []
        policy = core.engine.scheduler
        assert isinstance(policy, CMLFQ)
        [track] = policy.tracks.values()
        assert track.path == ["calculator:small:success"]
        await core.report(second.session, reward=1.0, done=True)
        assert policy.tracks == {}
    [record] = records
    assert (record.status, record.reward, record.turns, record.tokens) == (
        "completed",
        1.0,
        2,
        "exact",
    )
    assert_tokens_consistent(record, [CALCULATOR])


async def test_a_failing_server_is_retried_elsewhere(loopback: str, failing: str) -> None:
    async with loopback_core(failing, loopback) as (core, records):
        for _ in range(3):
            reply = await core.chat(ChatTurn(list(QUESTION)))
            assert reply.endpoint == "e1"
            await core.report(reply.session, done=True)
        request = CompletionRequest(model=MODEL, prompt="Once upon a time", max_tokens=4)
        for _ in range(2):  # round robin: one of them goes to the failing server first
            assert (await core.complete(request)).choices
    assert [r.status for r in records] == ["completed"] * 3
    assert all(r.endpoints == ["e1"] for r in records)


async def test_a_session_whose_every_server_failed_is_recorded_failed(failing: str) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    async with loopback_core(failing, dead) as (core, records):
        with pytest.raises(ServerUnavailable):
            await core.chat(ChatTurn(list(QUESTION)))
        assert len(core) == 0
    [record] = records
    assert (record.status, record.stop_reason, record.reward) == ("failed", "server_error", None)


async def test_reload_weights_bumps_the_version_sessions_record(
    loopback: str, tmp_path: Path
) -> None:
    (tmp_path / WEIGHTS_FILE).write_bytes(b"")
    async with loopback_core(loopback) as (core, records):
        first = await core.chat(ChatTurn(list(QUESTION), session="k"))
        assert first.weight_version == 0
        seconds = await core.reload_weights(str(tmp_path), 3)
        assert seconds >= 0 and core.status().versions == {"e0": 3}
        follow_up = [*QUESTION, echoed(first), Message(role="user", content="Sure?")]
        second = await core.chat(ChatTurn(follow_up, session="k"))
        assert second.weight_version == 3
        await core.report("k", done=True)
    [record] = records
    assert [span.version for span in record.weight_versions] == [0, 3]
    assert record.weight_version == 0


DICTATION = "Every token of this reply is sampled one decode step after the other. " * 4
SLOW = LatencyModel(
    prefill_s_per_token=0.0, step_base_s=0.005, step_per_seq_s=0.0, step_per_ctx_token_s=0.0
)  # the echoed dictation (280 tokens) takes ~1.4 s


async def running_requests(url: str) -> float:
    async with httpx.AsyncClient() as client:
        text = (await client.get(f"{url}/metrics")).text
    line = next(x for x in text.splitlines() if x.startswith("vllm:num_requests_running{"))
    return float(line.split()[-1])


async def test_a_pause_mid_turn_holds_the_request_without_failing_it() -> None:
    config = GatewayConfig(pause_mode="abort")
    replies: list[ChatReply] = []
    with running_emulator(EmulatorConfig(script="echo", latency=SLOW)) as url:
        async with loopback_core(url, config=config) as (core, records):

            async def dictate() -> None:
                message = Message(role="user", content=DICTATION)
                replies.append(await core.chat(ChatTurn([message], session="d")))

            async with anyio.create_task_group() as group:
                group.start_soon(dictate)
                with anyio.fail_after(10):
                    while await running_requests(url) < 1:  # noqa: ASYNC110 (another process)
                        await anyio.sleep(0.02)
                await anyio.sleep(0.3)
                await core.pause()  # the upstream aborts the generation: the turn waits
                assert core.status().paused and not replies
                await anyio.sleep(0.2)
                await core.resume()
            await core.report("d", done=True)
    [reply] = replies
    assert reply.content == DICTATION and reply.finish_reason == "stop"
    [record] = records
    assert record.turns == 1 and record.status == "completed"
    assert len(record.weight_versions) == 2  # one turn in two pieces
    assert_tokens_consistent(record, [])
