"""An agent's episodes on the emulated fleet, through a real loopback gateway and the
real ``openai`` SDK: one record per episode, with the job's identity and exact tokens;
faults (a raise, a timeout, a cancellation, no call, no reward) are failed, not scored."""

from __future__ import annotations

import json
from typing import Any

import anyio
import pytest

from libra.agents import Agent, load_agent
from libra.engine import RolloutSession, TrajectoryJob, TrajectoryRecord, jobs_for
from libra.envs import SandboxSpec, Task, UnknownEnvError
from libra.events import CallEnded, EventBus, TrajectoryEnded, TrajectoryStarted
from libra.launch import open_agent
from tests._helpers import Brevity, emulated_engine

pytestmark = pytest.mark.anyio

ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "a + b",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        },
    },
}
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


async def adder(task: Task, client: Any) -> float:
    """Its own tool loop: asks, runs the tool the model calls, answers, is scored."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": f"2 + 3? ({task.seed})"}]
    while True:
        reply = await client.chat.completions.create(
            model="m", messages=messages, tools=[ADD], max_tokens=256
        )
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return 1.0 if message.content == "5" else 0.0
        for call in message.tool_calls:
            arguments = json.loads(call.function.arguments)
            result = str(arguments["a"] + arguments["b"])
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})


async def hi(client: Any) -> None:
    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])


async def compacting(task: Task, client: Any) -> float:
    """Asks, then starts over from a summary of the first answer (a history edit)."""
    ask = [{"role": "user", "content": "Think about 2 + 3."}]
    first = await client.chat.completions.create(model="m", messages=ask)
    summary = f"Earlier you said: {first.choices[0].message.content}. Answer now."
    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": summary}])
    return 1.0


async def play(
    agent: Agent, replies: list[str], events: EventBus | None = None, **runner: Any
) -> TrajectoryRecord:
    job = TrajectoryJob(None, Task.from_seed(agent.name, 7), sample=1, step=2)
    async with (
        emulated_engine(replies, events=events) as (engine, recorded),
        open_agent(engine, agent, **runner) as run,
    ):
        record = await run(job, engine)
    assert recorded == [record]  # Engine.on_record: the episode's record, not its sessions
    return record


async def test_an_episode_is_one_exact_record_under_the_job_s_identity() -> None:
    record = await play(Agent("adder", adder), [CALL, "5"])
    assert (record.id, record.env, record.step, record.sample) == ("adder/7#1@2", "adder", 2, 1)
    assert record.group_id == "adder/7@2" and record.task_id == "adder/7"
    assert (record.status, record.reward, record.tokens) == ("completed", 1.0, "exact")
    assert record.turns == 2
    assert [r.status for r in record.tool_returns] == ["success"]
    assert sum(record.loss_mask) > 0 and len(record.token_ids) == len(record.logprobs)


async def test_an_agent_that_edits_its_history_trains_its_pieces_as_one_sample() -> None:
    record = await play(Agent("compacting", compacting), ["Hmm, five.", "5"])
    assert (record.status, record.reward, record.tokens, record.turns) == (
        "completed",
        1.0,
        "exact",
        2,
    )
    [start] = record.piece_starts  # two contexts, each the exact ids its model saw
    assert record.loss_mask[start] == 0 and sum(record.loss_mask[:start]) > 0
    assert sum(record.loss_mask[start:]) > 0


async def test_an_episode_s_events_carry_the_job_s_id_and_step_as_its_record_does() -> None:
    """Its start and end (the runner's), and each call of each of its pieces (the
    gateway's sessions, which publish no start or end of their own)."""
    bus = EventBus()
    seen = bus.subscribe()
    record = await play(Agent("compacting", compacting), ["Hmm, five.", "5"], events=bus)
    events = seen.take()
    assert [type(event) for event in events] == [
        TrajectoryStarted,
        CallEnded,
        CallEnded,
        TrajectoryEnded,
    ]
    ids = {getattr(event, "id", None) for event in events}
    assert ids == {record.id} == {"compacting/7#1@2"}
    assert isinstance(start := events[0], TrajectoryStarted)
    assert (start.env, start.step, start.task) == ("compacting", 2, "compacting/7")
    assert (record.env, record.step, record.task_id) == ("compacting", 2, "compacting/7")
    assert isinstance(end := events[-1], TrajectoryEnded)
    assert (end.reward, end.turns) == (record.reward, record.turns) == (1.0, 2)


async def test_an_agent_that_returns_no_reward_is_scored_by_the_run_s_env() -> None:
    async def quiet(task: Task, client: Any) -> None:
        await hi(client)

    record = await play(Agent("quiet", quiet), ["Short."], scorer=Brevity)
    assert record.status == "completed" and record.reward == Brevity().reward("Short.")
    unscored = await play(Agent("quiet", quiet), ["Short."])
    assert (unscored.status, unscored.stop_reason) == ("failed", "reward_error")
    assert unscored.reward is None
    assert "no env to score it" in (unscored.error or "")


async def test_the_scoring_env_lives_as_a_trajectory_s_does_reset_scored_closed() -> None:
    """Closed after its reward; one that needs a sandbox the run has none of is a fault
    (``reward_error``), never the policy's 0."""
    closed: list[str] = []

    class Closing(Brevity):
        async def close(self) -> None:
            closed.append("closed")

    class Boxed(Closing):
        sandbox_spec = SandboxSpec()

    async def quiet(task: Task, client: Any) -> None:
        await hi(client)

    record = await play(Agent("quiet", quiet), ["Short."], scorer=Closing)
    assert record.status == "completed" and closed == ["closed"]
    boxed = await play(Agent("quiet", quiet), ["Short."], scorer=Boxed)
    assert (boxed.status, boxed.stop_reason, boxed.reward) == ("failed", "reward_error", None)
    assert "runs tools in a sandbox, but none is configured" in (boxed.error or "")
    assert closed == ["closed", "closed"]


async def test_faults_are_failed_never_scored(capfd: pytest.CaptureFixture[str]) -> None:
    async def raising(task: Task, client: Any) -> float:
        await hi(client)
        raise ValueError("the agent's own bug")

    async def slow(task: Task, client: Any) -> float:
        await anyio.sleep(30)
        return 1.0

    async def silent(task: Task, client: Any) -> float:
        return 1.0

    raised = await play(Agent("raising", raising), ["Hi."])
    assert (raised.status, raised.stop_reason, raised.reward) == ("failed", "agent_error", None)
    assert raised.error == "ValueError: the agent's own bug" and raised.turns == 1
    assert "the agent's own bug" in capfd.readouterr().err  # its traceback, once
    timed_out = await play(Agent("slow", slow), [], timeout_s=0.2)
    assert (timed_out.status, timed_out.stop_reason) == ("failed", "agent_timeout")
    no_call = await play(Agent("silent", silent), [])
    assert (no_call.status, no_call.stop_reason, no_call.reward) == ("failed", "no_call", None)


async def test_a_rollout_session_runs_agents_and_records_each_once() -> None:
    async def hanging(task: Task, client: Any) -> float:
        await hi(client)
        if task.seed % 2:
            await anyio.sleep_forever()
        return float(task.seed % 3)

    agent = Agent("hanging", hanging)
    jobs = [TrajectoryJob(None, Task.from_seed("hanging", seed)) for seed in range(4)]
    async with (
        emulated_engine(["Hi."]) as (engine, _),
        open_agent(engine, agent) as run,
        RolloutSession(engine, runner=run) as session,
    ):
        session.submit(jobs)
        records = []
        with anyio.fail_after(10):
            async for record in session.records():  # the even seeds' episodes end
                records.append(record)
                if len(records) == 2:
                    break
        session.cancel()
        records += [record async for record in session.records()]
    by_id = {record.id: record for record in records}
    assert sorted(by_id) == sorted(str(job.id) for job in jobs) and len(records) == 4
    assert {by_id[str(job.id)].stop_reason for job in jobs[1::2]} == {"cancelled"}
    assert [by_id[str(job.id)].reward for job in jobs[::2]] == [0.0, 2.0]


def test_an_agent_is_an_async_def_found_by_module_and_name() -> None:
    assert load_agent("tests.agents.test_runner:adder").name == "adder"
    with pytest.raises(UnknownEnvError, match="must be an async def"):
        load_agent("tests.agents.test_runner:play_sync")
    with pytest.raises(UnknownEnvError, match=r"package\.module:name"):
        load_agent("adder")


def play_sync(task: Task, client: Any) -> float:
    return 0.0


def test_jobs_need_no_env() -> None:
    assert {job.env_cls for job in jobs_for(None, "agent", 4, samples_per_prompt=2)} == {None}
