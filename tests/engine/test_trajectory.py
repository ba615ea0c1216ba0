"""The trajectory coroutine against the in-process emulated server (and a hung one on
loopback)."""

from __future__ import annotations

import threading
import time

import anyio
import msgspec
import pytest

from libra.emulation import LatencyModel
from libra.engine import (
    Engine,
    EngineConfig,
    SamplingConfig,
    TrajectoryJob,
    TrajectoryRecord,
    http_transport,
    run_trajectory,
)
from libra.envs import Env, ToolError, tool
from libra.fleet import Api, Endpoint
from libra.sched.policies import LeastLoadedScheduler
from tests._helpers import (
    MODEL,
    assert_tokens_consistent,
    emulated_engine,
    hung_server,
    sampled_spans,
    tokenizer,
)

pytestmark = pytest.mark.anyio


class Toy(Env):
    """An env with one tool of every temperament."""

    system_prompt = "You are testing tools."
    max_turns = 4
    tool_timeout_s = 0.5

    def reset(self, seed: int) -> str:
        self.seed = seed
        return f"Add {seed} and 2."

    @tool
    def add(self, a: int, b: int) -> int:
        """Add two whole numbers."""
        return a + b

    @tool
    async def finish(self, answer: int) -> str:
        """Submit the answer and end the episode."""
        self.done = True
        self.submitted = answer
        return "submitted"

    @tool
    def boom(self) -> str:
        """Raise."""
        raise ValueError("kaboom")

    @tool
    def refuse(self) -> str:
        """Refuse politely."""
        raise ToolError("not today")

    @tool
    async def hang(self) -> str:
        """Never return."""
        await anyio.sleep_forever()
        return ""

    @tool
    def block(self) -> str:
        """Block a thread for longer than the tool timeout."""
        time.sleep(1.5)
        return "woke up"

    def reward(self, answer: str) -> float:
        if getattr(self, "submitted", None) is not None:
            return float(self.submitted == self.seed + 2)
        return float(answer.strip().endswith(str(self.seed + 2)))


def call(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


async def run(replies: list[str], *, api: Api = "auto", **config: object) -> TrajectoryRecord:
    engine_config = EngineConfig.model_validate(config)
    async with emulated_engine(replies, api=api, config=engine_config) as (engine, out):
        record = await run_trajectory(TrajectoryJob.seeded(Toy, "toy", 5), engine)
    assert out == [record]
    assert_tokens_consistent(record, Toy.tool_schemas())
    return record


@pytest.mark.parametrize("api", ["auto", "tokens"])
async def test_tool_then_answer_records_exact_tokens(api: Api) -> None:
    replies = ["Let me add. " + call("add", '{"a": 5, "b": 2}'), "The answer is 7"]
    record = await run(replies, api=api)
    assert (record.status, record.stop_reason, record.reward) == ("completed", "model_stop", 1.0)
    assert record.turns == 2 and record.tokens == "exact"
    assert [m.role for m in record.messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert record.messages[3].content == "7"
    assert [r.tool for r in record.tool_returns] == ["add"]
    assert record.tool_returns[0].status == "success"
    assert record.tool_returns[0].size_class == "small"
    # The model's spans are exactly the ids the server sampled, end-of-turn token included.
    assert sampled_spans(record) == [[*tokenizer.encode(r), 258] for r in replies]


async def test_tools_are_described_in_the_system_message_when_the_template_drops_them() -> None:
    replies = [call("add", '{"a": 5, "b": 2}'), "The answer is 7"]
    async with emulated_engine(replies, template_renders_tools=False) as (engine, _):
        record = await run_trajectory(TrajectoryJob.seeded(Toy, "toy", 5), engine)
    system = record.messages[0].content or ""
    assert system.startswith(Toy.system_prompt) and "<tools>" in system and '"add"' in system
    assert record.reward == 1.0 and record.tokens == "exact"
    assert_tokens_consistent(record, tools=[])  # the template shows no tools of its own


async def test_chat_mode_detects_retokenization_drift() -> None:
    # The server splits the call out of the text (like vLLM's hermes parser); re-rendering
    # the assistant message then gives other tokens than the model sampled: the template
    # writes "add. \n<tool_call>" where the model wrote "add. <tool_call>".
    replies = ["Let me add. " + call("add", '{"a": 5, "b": 2}'), "The answer is 7"]
    record = await run(replies, api="chat")
    assert record.status == "completed" and record.tokens == "drift"
    assert sampled_spans(record) == [[*tokenizer.encode(replies[0]), 258]]  # exact up to drift
    exact = await run(replies, api="tokens")
    assert exact.tokens == "exact" and len(sampled_spans(exact)) == 2


async def test_env_ends_the_episode_from_a_tool() -> None:
    record = await run([call("finish", '{"answer": 7}')])
    assert (record.status, record.stop_reason, record.reward) == ("completed", "env_done", 1.0)


@pytest.mark.parametrize(
    ("reply", "error"),
    [
        ('<tool_call>{"name": "add", "arguments": {"a": 1,</tool_call>', "not valid JSON"),
        (call("subtract", '{"a": 1, "b": 2}'), "unknown tool 'subtract'"),
        (call("add", '{"a": "one", "b": 2}'), "invalid arguments for add: a:"),
        (call("add", '{"a": 1}'), "invalid arguments for add: b: Field required"),
        (call("add", '{"a": 1, "b": 2, "c": 3}'), "c: Extra inputs are not permitted"),
        ('<tool_call>["add", 1, 2]</tool_call>', 'has no "name"'),
        (call("boom", "{}"), "ValueError: kaboom"),
        (call("refuse", "{}"), "Error: not today"),
    ],
)
async def test_bad_tool_calls_become_errors_the_model_reads(reply: str, error: str) -> None:
    record = await run([reply, "I give up"])
    assert record.status == "completed"
    assert record.tool_returns[0].status == "failure"
    tool_message = record.messages[3]
    assert tool_message.role == "tool" and tool_message.content is not None
    assert tool_message.content.startswith("Error:") and error in tool_message.content


async def test_a_tool_s_bug_is_recorded_as_one_and_its_traceback_shown_once(
    capsys: pytest.CaptureFixture[str],
) -> None:
    replies = [call("boom", "{}") + call("refuse", "{}"), call("boom", "{}"), "I give up"]
    async with emulated_engine(replies) as (engine, _):
        records = [
            await run_trajectory(TrajectoryJob.seeded(Toy, "toy", s), engine) for s in (1, 2)
        ]
    returns = [(r.tool, r.status, r.exception) for record in records for r in record.tool_returns]
    bug, refusal = ("boom", "failure", "ValueError"), ("refuse", "failure", None)
    assert returns == [bug, refusal, bug] * 2  # a deliberate ToolError is no exception
    assert all(record.status == "completed" for record in records)
    shown = capsys.readouterr().err
    assert shown.count("Traceback (most recent call last)") == 1
    assert shown.startswith("libra: a bug in tool boom of env Toy: ValueError (its traceback")
    assert 'raise ValueError("kaboom")' in shown


async def test_a_bug_in_reward_or_close_shows_its_traceback_once(
    capsys: pytest.CaptureFixture[str],
) -> None:
    class BadReward(Toy):
        def reward(self, answer: str) -> float:
            return float(answer.split()[99])

        async def close(self) -> None:
            raise OSError("already closed")

    async with emulated_engine(["The answer is 7"]) as (engine, _):
        for seed in (1, 2, 3):
            record = await run_trajectory(TrajectoryJob.seeded(BadReward, "toy", seed), engine)
            assert (record.stop_reason, record.error) == (
                "reward_error",
                "IndexError: list index out of range",
            )
    shown = capsys.readouterr().err
    assert shown.count("Traceback (most recent call last)") == 2  # one per place and type
    assert "libra: a bug in reward of env BadReward: IndexError" in shown
    assert "answer.split()[99]" in shown
    assert "libra: a bug in close of env BadReward: OSError" in shown


@pytest.mark.faults
@pytest.mark.parametrize("name", ["hang", "block"])
async def test_a_tool_that_hangs_times_out(name: str) -> None:
    started = time.monotonic()
    record = await run([call(name, "{}"), "done"])
    assert record.tool_returns[0].status == "timeout"
    assert record.messages[3].content == f"Error: {name} timed out after 0.5 s"
    assert record.status == "completed"
    assert time.monotonic() - started < 1.4  # the blocked thread is abandoned, not awaited


@pytest.mark.faults
async def test_garbage_from_the_model_ends_in_one_record() -> None:
    record = await run(["\x00\x01 ~~~ <tool_call> {{{ </tool_", "<tool_call></tool_call>", "?"])
    assert record.status == "completed"
    assert all(r.status == "failure" for r in record.tool_returns)


async def test_max_turns_truncates() -> None:
    record = await run([call("add", '{"a": 1, "b": 1}')] * 4)
    assert (record.status, record.stop_reason, record.turns) == ("truncated", "max_turns", 4)
    assert record.reward == 0.0  # truncated episodes are still scored


async def test_max_tokens_per_turn_truncates() -> None:
    sampling = SamplingConfig(max_tokens_per_turn=5)
    record = await run(["a long reply that will not fit"], sampling=sampling)
    assert (record.status, record.stop_reason) == ("truncated", "max_tokens")
    assert sampled_spans(record) == [tokenizer.encode("a lon")]


@pytest.mark.parametrize("api", ["tokens", "chat"])
async def test_a_turn_cut_by_max_tokens_can_still_run_its_calls(api: Api) -> None:
    written = call("add", '{"a": 5, "b": 2}')
    replies = [written + " and on and on and on", "The answer is 7", "so on and so on"]
    sampling = SamplingConfig(max_tokens_per_turn=len(written) + 4)
    record = await run(replies, api=api, sampling=sampling, on_max_tokens="continue")
    assert (record.status, record.reward) == ("completed", 1.0)
    assert [r.status for r in record.tool_returns] == ["success"]
    if api == "tokens":  # the cut turn is closed by an end-of-turn token it did not sample
        end = record.weight_versions[0].end
        assert (record.token_ids[end], record.loss_mask[end]) == (258, 0)
    # A cut turn without calls still ends the trajectory.
    sampling = SamplingConfig(max_tokens_per_turn=5)
    cut = await run(replies[2:], api=api, sampling=sampling, on_max_tokens="continue")
    assert (cut.status, cut.stop_reason) == ("truncated", "max_tokens")


async def test_context_budget_truncates() -> None:
    record = await run([call("add", '{"a": 1, "b": 1}')] * 3, max_context_tokens=1750)
    assert (record.status, record.stop_reason) == ("truncated", "max_context_tokens")
    assert len(record.token_ids) == 1750


async def test_wall_clock_limit_truncates() -> None:
    record = await run([call("hang", "{}")] * 4, max_wall_s=0.2)
    assert (record.status, record.stop_reason) == ("truncated", "max_wall_s")


async def on_a_hung_server(**config: object) -> TrajectoryRecord:
    """A trajectory whose only server lists its model, then never answers."""
    settings = {"call_timeout_s": 0.3, "call_timeout_per_token_s": 0.0, **config}
    async with hung_server() as url, http_transport("httpx") as http:
        engine_config = EngineConfig.model_validate(settings)
        records: list[TrajectoryRecord] = []
        scheduler = LeastLoadedScheduler([Endpoint(url, model=MODEL)])
        engine = Engine(http, scheduler, config=engine_config, on_record=records.append)
        record = await run_trajectory(TrajectoryJob.seeded(Toy, "toy", 5), engine)
        assert not any(scheduler.calls_in_flight().values())
    assert records == [record]  # one record, and only one
    return record


@pytest.mark.faults
async def test_a_hung_server_at_the_wall_clock_limit_is_a_server_error_not_truncation() -> None:
    """The wall falls while the turn retries calls that hung: the fleet's doing."""
    record = await on_a_hung_server(max_wall_s=1.0, max_attempts=100, retry_backoff_s=0.05)
    assert (record.status, record.stop_reason, record.reward) == ("failed", "server_error", None)
    assert record.error is not None
    assert record.error.startswith("max_wall_s (1 s) reached after ")
    assert "failed attempts, the last: " in record.error and "(taken as hung)" in record.error


@pytest.mark.faults
async def test_a_hung_server_that_fails_every_attempt_is_a_server_error() -> None:
    record = await on_a_hung_server(max_attempts=2, retry_backoff_s=0.0)
    assert (record.status, record.stop_reason, record.reward) == ("failed", "server_error", None)
    assert record.error is not None and record.error.startswith("2 failed attempts, the last: ")
    assert record.timings.total_s < 5  # two short timeouts, not the 600 s request cap


@pytest.mark.faults
async def test_the_wall_clock_limit_while_waiting_for_an_endpoint_is_a_server_error() -> None:
    config = EngineConfig(max_wall_s=0.3, capacity_wait_s=60)
    async with emulated_engine(["The answer is 7"], config=config) as (engine, out):
        router = engine.scheduler.router
        (only,) = router.instances
        await router.retire(only.name)  # the fleet is empty: no server to serve the call
        record = await run_trajectory(TrajectoryJob.seeded(Toy, "toy", 5), engine)
    assert out == [record]
    assert (record.status, record.stop_reason, record.reward) == ("failed", "server_error", None)
    assert record.error is not None
    assert record.error.startswith("max_wall_s (0.3 s) reached after waiting for a usable endpoint")


async def test_the_wall_clock_limit_during_a_slow_healthy_generation_truncates() -> None:
    """A call in flight within its own timeout is a server at work: the model's long
    reply ran out of time, so it is truncated and scored."""
    slow = LatencyModel(
        prefill_s_per_token=0.0, step_base_s=0.02, step_per_seq_s=0.0, step_per_ctx_token_s=0.0
    )
    config = EngineConfig(max_wall_s=0.5)
    async with emulated_engine(["x" * 200], config=config, latency=slow) as (engine, out):
        record = await run_trajectory(TrajectoryJob.seeded(Toy, "toy", 5), engine)
    assert out == [record]
    assert (record.status, record.stop_reason, record.error) == ("truncated", "max_wall_s", None)
    assert record.reward == 0.0  # scored: the model had not answered


async def test_chat_mode_without_token_ids_records_text_only() -> None:
    class NoIds(Toy):
        pass

    async with emulated_engine(["The answer is 7"], api="chat") as (engine, _):
        original = engine.client.chat

        async def chat_without_ids(*args, **kwargs):  # type: ignore[no-untyped-def]
            generation = await original(*args, **kwargs)
            return type(generation)(generation.text, generation.finish_reason)

        engine.client.chat = chat_without_ids  # type: ignore[method-assign]
        record = await run_trajectory(TrajectoryJob.seeded(NoIds, "toy", 5), engine)
    assert record.status == "completed" and record.reward == 1.0
    assert record.tokens == "none" and record.token_ids == [] and record.loss_mask == []


async def test_env_errors_fail_the_trajectory_not_the_engine() -> None:
    class BrokenReset(Toy):
        def reset(self, seed: int) -> str:
            raise RuntimeError("no task")

    class BrokenReward(Toy):
        def reward(self, answer: str) -> float:
            raise KeyError("score")

    async with emulated_engine(["The answer is 7"]) as (engine, _):
        broken_reset = await run_trajectory(TrajectoryJob.seeded(BrokenReset, "toy", 1), engine)
        broken_reward = await run_trajectory(TrajectoryJob.seeded(BrokenReward, "toy", 1), engine)
    assert (broken_reset.status, broken_reset.stop_reason) == ("failed", "env_error")
    assert broken_reset.error == "RuntimeError: no task"
    assert (broken_reward.status, broken_reward.stop_reason) == ("failed", "reward_error")
    assert broken_reward.reward is None


@pytest.mark.parametrize("api", ["tokens", "chat"])
async def test_on_reply_continues_the_conversation(api: Api) -> None:
    class Tutor(Toy):
        def on_reply(self, text: str) -> str | None:
            return None if "7" in text else "Check your arithmetic."

    async with emulated_engine(["It is 8", "The answer is 7"], api=api) as (engine, _):
        record = await run_trajectory(TrajectoryJob.seeded(Tutor, "toy", 5), engine)
    assert [m.role for m in record.messages][-3:] == ["assistant", "user", "assistant"]
    assert record.tokens == "exact"  # plain text round-trips through the chat template
    assert record.reward == 1.0
    assert_tokens_consistent(record, Tutor.tool_schemas())


@pytest.mark.parametrize("api", ["tokens", "chat"])
async def test_a_stop_string_ends_the_turn_and_its_call_runs(api: Api) -> None:
    class Stopping(Toy):
        stop_strings = ("</tool_call>",)

    written = "Let me add. " + call("add", '{"a": 5, "b": 2}')
    replies = [written + " and it prints 9, I bet", "The answer is 7"]
    async with emulated_engine(replies, api=api) as (engine, _):
        record = await run_trajectory(TrajectoryJob.seeded(Stopping, "toy", 5), engine)
    # The turn ends at the stop string, tokens and all; the call runs.
    assert record.messages[3].content == "7" and record.reward == 1.0
    assert sampled_spans(record)[0] == tokenizer.encode(written)
    assert_tokens_consistent(record, Stopping.tool_schemas())
    if api == "tokens":  # (the chat API's server split the call out of the text)
        assert record.messages[2].content == written and record.tokens == "exact"
        # No end-of-turn token was sampled: the template's one follows, not learnt from.
        end = record.weight_versions[0].end
        assert (record.token_ids[end], record.loss_mask[end]) == (258, 0)


# ------------------------------------------------ bad input from the model and the env


class Rough(Toy):
    """Tools and prompts with rough edges: long, huge, undecodable."""

    max_tool_output_chars = 1000

    @tool
    def echo(self, text: str) -> str:
        """Say it back."""
        return f"{len(text)} characters"

    @tool
    def dump(self) -> str:
        """Print a whole file."""
        return "start " + "x" * 100_000 + " end"

    @tool
    def undecodable(self) -> str:
        """What a program printed, decoded as Python does for subprocess output."""
        return b"ok \xff\xfe bad".decode("utf-8", "surrogateescape")

    @tool
    def raw(self) -> bytes:
        """Bytes, as a program printed them."""
        return b"ok \xff bytes"


async def run_rough(env: type[Env], replies: list[str], **config: object) -> TrajectoryRecord:
    room: dict[str, object] = {"sampling": SamplingConfig(max_tokens_per_turn=12_000)}
    engine_config = EngineConfig.model_validate({"max_context_tokens": 20_000, **room, **config})
    async with emulated_engine(replies, config=engine_config) as (engine, out):
        record = await run_trajectory(TrajectoryJob.seeded(env, "rough", 5), engine)
    assert out == [record]
    msgspec.json.encode(record)  # whatever came in, the record can be written
    return record


@pytest.mark.parametrize(
    ("arguments", "error"),
    [
        ('{"text": ' + "[" * 3000 + "]" * 3000 + "}", "cannot be read: it is nested too deeply"),
        ('{"text": ' + "9" * 5000 + "}", "cannot be read: Exceeds the limit (4300 digits)"),
    ],
)
async def test_oversized_arguments_are_an_error_the_model_reads(arguments: str, error: str) -> None:
    record = await run_rough(Rough, [call("echo", arguments), "I give up"])
    assert (record.status, record.stop_reason) == ("completed", "model_stop")
    assert [r.status for r in record.tool_returns] == ["failure"]
    assert error in (record.messages[3].content or "")


async def test_a_long_argument_reaches_the_tool_whole() -> None:
    record = await run_rough(Rough, [call("echo", '{"text": "' + "y" * 8000 + '"}'), "done"])
    assert record.messages[3].content == "8000 characters"


async def test_a_huge_tool_output_is_cut_to_its_start_and_end() -> None:
    record = await run_rough(Rough, [call("dump", "{}"), "done"])
    shown = record.messages[3].content or ""
    assert len(shown) == 1000 == record.tool_returns[0].chars
    assert shown.startswith("start xx") and shown.endswith("xx end")
    assert "[... 99,010 characters cut ...]" in shown
    assert record.status == "completed"


@pytest.mark.parametrize("name", ["undecodable", "raw"])
async def test_undecodable_tool_output_reaches_the_model_as_replacement_characters(
    name: str,
) -> None:
    record = await run_rough(Rough, [call(name, "{}"), "done"])
    assert record.status == "completed" and record.tool_returns[0].status == "success"
    assert (record.messages[3].content or "").startswith("ok \ufffd")


async def test_an_undecodable_prompt_is_sent_with_replacement_characters() -> None:
    class Undecodable(Rough):
        def reset(self, seed: int) -> str:
            self.seed = seed
            return b"Add \xff 5 and 2.".decode("utf-8", "surrogateescape")

    record = await run_rough(Undecodable, ["The answer is 7"])
    assert record.status == "completed" and record.messages[1].content == "Add \ufffd 5 and 2."


class Verbose(Rough):
    def reset(self, seed: int) -> str:
        self.seed = seed
        return "word " * 8_000  # 40,000 tokens of the emulator's byte tokenizer


@pytest.mark.parametrize(
    ("limit", "error"),
    [
        (20_000, "tokens; max_context_tokens is 20000"),
        (100_000, "the server said: "),  # the server's context (32768) is smaller
    ],
)
async def test_a_prompt_longer_than_the_context_fails_unscored(limit: int, error: str) -> None:
    record = await run_rough(Verbose, ["The answer is 7"], max_context_tokens=limit)
    assert (record.status, record.stop_reason, record.reward) == ("failed", "prompt_too_long", None)
    assert record.error is not None and error in record.error
    assert record.turns == 0


class Gated(Env):
    """A blocking tool that hangs (on a gate the test opens) for seed 1 only."""

    max_turns = 3
    tool_timeout_s = 0.3
    gate = threading.Event()

    def reset(self, seed: int) -> str:
        self.seed = seed
        return "Open the gate."

    @tool
    def open_gate(self) -> str:
        """Open the gate."""
        if self.seed == 1:
            self.gate.wait(10)
        return "opened"

    def reward(self, answer: str) -> float:
        return 1.0


@pytest.mark.faults
async def test_a_hung_blocking_tool_times_out_and_holds_its_thread_until_it_returns() -> None:
    """With one tool thread, a hung tool times out for the model; the next trajectory's
    call waits for the thread (longer than its timeout, which has not started) and runs
    once the hung tool returns. Each trajectory ends in one record."""
    Gated.gate = threading.Event()
    config = EngineConfig(tool_threads=1)
    replies = [call("open_gate", "{}"), "done"]
    async with emulated_engine(replies, config=config) as (engine, out):
        records: dict[int, TrajectoryRecord] = {}

        async def run_seed(seed: int) -> None:
            records[seed] = await run_trajectory(TrajectoryJob.seeded(Gated, "gated", seed), engine)

        async with anyio.create_task_group() as tg:
            tg.start_soon(run_seed, 1)
            with anyio.fail_after(5):
                while 1 not in records:  # noqa: ASYNC110 (a test watching its records)
                    await anyio.sleep(0.01)
            assert (engine.tool_threads.busy, engine.tool_threads.abandoned) == (1, 1)
            tg.start_soon(run_seed, 2)
            with anyio.fail_after(5):
                while engine.tool_threads.waiting < 1:  # noqa: ASYNC110 (counters)
                    await anyio.sleep(0.01)
            await anyio.sleep(0.5)  # past its timeout, waiting for the thread
            assert 2 not in records
            Gated.gate.set()
    assert sorted(out, key=lambda r: r.task_id) == [records[1], records[2]]
    assert records[1].tool_returns[0].status == "timeout"
    assert records[1].messages[-2].content == "Error: open_gate timed out after 0.3 s"
    assert records[2].tool_returns[0].status == "success"
    assert records[2].messages[-2].content == "opened"
    assert records[2].tool_returns[0].latency_s < 0.3  # its 0.5 s wait for a thread is not its time
    assert all(r.status == "completed" for r in out)
    assert (engine.tool_threads.busy, engine.tool_threads.abandoned) == (0, 0)
