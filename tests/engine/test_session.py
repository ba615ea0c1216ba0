"""The rollout session: steps that overlap, a bounded stream, groups, pause and resume."""

from __future__ import annotations

import gc
from collections import Counter
from collections.abc import Callable, Iterator

import anyio
import anyio.lowlevel
import pytest

from envs_contrib.calc import Calc
from envs_contrib.guess import Guess
from libra.emulation import EmulatorConfig, LatencyModel, running_emulator
from libra.engine import (
    Engine,
    EngineConfig,
    Group,
    RolloutSession,
    TrajectoryJob,
    http_transport,
    jobs_for,
    jobs_of,
)
from libra.engine._gc import YOUNG_THRESHOLD
from libra.envs import Env, GroupId, Task, TaskId
from libra.fleet import FleetSpec, InstanceSpec
from libra.sched import CallOutcome, Route, Router, RouteRequest, Scheduler
from libra.sched.policies import RoutedPolicy, make_policy
from libra.signals import ToolSignal
from tests._helpers import MODEL, emulated_engine

pytestmark = pytest.mark.anyio

# Slow enough that trajectories overlap: a few milliseconds per generated token.
SLOW = LatencyModel(
    prefill_s_per_token=0.0, step_base_s=0.002, step_per_seq_s=0.0, step_per_ctx_token_s=0.0
)


@pytest.fixture(scope="module")
def fleet() -> Iterator[FleetSpec]:
    """Two emulated servers, each a real process on a real port."""
    config = EmulatorConfig(latency=SLOW)
    with running_emulator(config) as first, running_emulator(config) as second:
        instances = [
            InstanceSpec(name="a", url=first, model=MODEL),
            InstanceSpec(name="b", url=second, model=MODEL),
        ]
        yield FleetSpec(instances=instances)


async def until(condition: Callable[[], bool]) -> None:
    """Poll the session's counters until ``condition`` holds (10 s at most)."""
    with anyio.fail_after(10):
        while not condition():  # noqa: ASYNC110 (a test watching counters, not an event)
            await anyio.sleep(0.001)


def check_groups(groups: list[Group], jobs: list[TrajectoryJob]) -> None:
    """Every job gave exactly one record, ids are unique, every group is whole."""
    records = [record for group in groups for record in group.records]
    ids = [record.id for record in records]
    assert len(ids) == len(set(ids)) == len(jobs)
    assert set(ids) == {str(job.id) for job in jobs}
    assert len({group.id for group in groups}) == len(groups)
    sizes = Counter(job.group_id for job in jobs)
    for group in groups:
        assert [r.sample for r in group.records] == list(range(sizes[group.id]))
        assert {(r.group_id, r.step, r.task_id) for r in group.records} == {
            (str(group.id), group.id.step, str(group.id.task))
        }


# ------------------------------------------------------------------- done when


@pytest.mark.slow
async def test_three_overlapping_steps_on_an_emulated_fleet(fleet: FleetSpec) -> None:
    """Each step's jobs are submitted while the last one's stragglers run, over the same
    tasks; concurrency goes 8 -> 2 -> 6 on the way."""
    policy = make_policy("cmlfq", fleet)
    assert isinstance(policy, RoutedPolicy)
    jobs: list[TrajectoryJob] = []
    groups: list[Group] = []
    overlapped: list[bool] = []
    peaks = {2: 0, 6: 0}
    async with http_transport("httpx") as http:
        engine = Engine(http, policy, config=EngineConfig(concurrency=8))
        async with RolloutSession(engine) as session, anyio.create_task_group() as watchers:

            def submit(step: int) -> None:
                if step > 0:  # the last step still runs
                    last = session.step_stats[step - 1]
                    overlapped.append(last.done < last.total)
                more = jobs_for(Calc, "calc", 24, samples_per_prompt=4, seed=0, step=step)
                jobs.extend(more)
                session.submit(more)

            async def watch() -> None:
                settled = False  # the lower limit has taken hold: the excess has ended
                while True:
                    limit, running = session.concurrency, session.in_flight
                    settled = settled or (limit == 2 and running <= 2)
                    if limit == 6 or settled:
                        peaks[limit] = max(peaks[limit], running)
                    await anyio.sleep(0.001)

            watchers.start_soon(watch)
            submit(0)
            ended: Counter[int] = Counter()
            async for group in session.groups():
                groups.append(group)
                ended[group.id.step] += 1
                if ended[group.id.step] == 3 and group.id.step < 2:  # half of the step
                    session.set_concurrency(2 if group.id.step == 0 else 6)
                    submit(group.id.step + 1)
                    if group.id.step == 1:
                        session.close()
            watchers.cancel_scope.cancel()
    check_groups(groups, jobs)
    assert len(groups) == 18 and all(not group.failed for group in groups)
    assert overlapped == [True, True]
    # The same tasks at every step, under keys that never met in the scheduler.
    assert len({group.id.task for group in groups}) == 6
    assert policy.tracks == {} and policy.router.home == {}
    assert 0 < peaks[2] <= 2 < peaks[6] <= 6
    assert [session.step_stats[s].done for s in range(3)] == [24, 24, 24]
    assert session.stats.done == session.stats.total == 72


# ----------------------------------------------------- one scheduler, two steps


class LiveKeys:
    """A scheduler that checks the keys it is given: a trajectory's key is never reused,
    and it counts how many live trajectories share a prompt at once."""

    def __init__(self, inner: Scheduler) -> None:
        self.inner = inner
        self.live: dict[str, str] = {}  # trajectory key -> prompt key
        self.ended: set[str] = set()
        self.most_per_prompt = 0

    @property
    def router(self) -> Router:
        return self.inner.router

    def route(self, request: RouteRequest, exclude: frozenset[str] = frozenset()) -> Route:
        key = request.trajectory_id
        assert key not in self.ended, f"{key} was reused"
        self.live[key] = request.prompt_id
        sharing = Counter(self.live.values())[request.prompt_id]
        self.most_per_prompt = max(self.most_per_prompt, sharing)
        return self.inner.route(request, exclude)

    def release(self, route: Route, *, outcome: CallOutcome, new_tokens: int) -> None:
        self.inner.release(route, outcome=outcome, new_tokens=new_tokens)

    def on_tool_return(self, trajectory_id: str, signal: ToolSignal) -> None:
        assert trajectory_id in self.live
        self.inner.on_tool_return(trajectory_id, signal)

    def on_finish(
        self, trajectory_id: str, prompt_id: str, *, output_tokens: int, failed: bool = False
    ) -> None:
        assert self.live.pop(trajectory_id, prompt_id) == prompt_id
        self.ended.add(trajectory_id)
        self.inner.on_finish(trajectory_id, prompt_id, output_tokens=output_tokens, failed=failed)

    def calls_in_flight(self) -> dict[str, int]:
        return self.inner.calls_in_flight()


async def test_two_steps_of_the_same_tasks_keep_apart_in_the_scheduler() -> None:
    slow = LatencyModel(prefill_s_per_token=0.0, step_base_s=0.001)
    async with emulated_engine(latency=slow, config=EngineConfig(concurrency=16)) as (engine, _):
        engine.scheduler = watch = LiveKeys(engine.scheduler)
        both = [
            job
            for step in (0, 1)
            for job in jobs_for(Guess, "guess", 8, samples_per_prompt=2, step=step)
        ]
        async with RolloutSession(engine) as session:
            session.submit(both)
            session.close()
            records = [record async for record in session]
    assert len({r.id for r in records}) == 16 == len(watch.ended)
    assert all(r.status != "failed" for r in records)
    assert watch.most_per_prompt > 2  # both steps' samples of one task ran side by side
    assert watch.live == {}
    tasks = [{r.task_id for r in records if r.step == step} for step in (0, 1)]
    assert tasks[0] == tasks[1] and len(tasks[0]) == 4


async def test_a_job_already_in_the_session_is_refused() -> None:
    job = TrajectoryJob.seeded(Guess, "guess", 1)
    async with emulated_engine() as (engine, _):
        async with RolloutSession(engine) as session:
            session.pause()
            session.submit([job])
            with pytest.raises(ValueError, match="already in the session"):
                session.submit([job])
            with pytest.raises(ValueError, match="already in the session"):
                session.submit([TrajectoryJob.seeded(Guess, "guess", 2)] * 2)
            session.submit([TrajectoryJob.seeded(Guess, "guess", 1, step=1)])  # another step
            assert session.queued == 2
            async with RolloutSession(engine) as other:  # the same scheduler: refused too
                with pytest.raises(ValueError, match="already in the session"):
                    other.submit([job])
            assert len(session.cancel()) == 2 and engine.live_ids == set()
        async with RolloutSession(engine) as again:  # once dropped or ended, an id is free
            again.submit([job])
            again.close()
            records = [record async for record in again]
    assert [(r.id, r.status) for r in records] == [(str(job.id), "completed")]


async def test_an_open_session_collects_garbage_less_often() -> None:
    before = gc.get_threshold()
    async with emulated_engine() as (engine, _), RolloutSession(engine) as session:
        session.submit(jobs_for(Guess, "guess", 4))
        session.close()
        records = [record async for record in session]
        during = gc.get_threshold()
    assert len(records) == 4
    assert during[0] == max(before[0], YOUNG_THRESHOLD) or before[0] == 0
    assert gc.get_threshold() == before


# ------------------------------------------------------------------ the stream


async def test_a_slow_reader_bounds_what_is_held() -> None:
    config = EngineConfig(concurrency=4, buffer=3)
    async with emulated_engine(config=config) as (engine, _), RolloutSession(engine) as session:
        session.submit(jobs_for(Calc, "calc", 40))
        session.close()
        await until(lambda: session.stats.done >= 7)
        await anyio.sleep(0.2)  # nothing reads: everything stops
        assert (session.buffered, session.in_flight, session.stats.done) == (3, 4, 7)
        assert session.queued == 33
        assert session.open_groups == 40
        records = []
        async for record in session:
            assert session.buffered <= 3
            records.append(record)
            await anyio.sleep(0.001)
        assert session.open_groups == 0  # read one by one, not as groups: none kept
    assert len({r.id for r in records}) == 40 and all(r.status != "failed" for r in records)


async def test_reading_records_or_groups_keeps_no_count_of_the_groups_read() -> None:
    """Found by the soak: records read one by one left their group's count behind, one
    entry per group for as long as the session lived."""
    async with emulated_engine() as (engine, _):
        for view in ("records", "groups"):
            async with RolloutSession(engine) as session:
                session.submit(jobs_for(Calc, "calc", 12, samples_per_prompt=4, seed=5))
                assert session.open_groups == 3
                session.close()
                stream = session.records() if view == "records" else session.groups()
                read = [item async for item in stream]
                assert session.open_groups == 0
            assert len(read) == (12 if view == "records" else 3)


async def test_pause_lets_the_flight_land_and_resume_starts_the_queue() -> None:
    slow = LatencyModel(prefill_s_per_token=0.0, step_base_s=0.001)
    config = EngineConfig(concurrency=2)
    async with (
        emulated_engine(latency=slow, config=config) as (engine, _),
        RolloutSession(engine) as session,
    ):
        session.submit(jobs_for(Guess, "guess", 10))
        await until(lambda: session.in_flight >= 2)
        session.pause()
        await anyio.lowlevel.checkpoint()
        await until(lambda: session.in_flight == 0)  # the two in flight land
        landed = session.stats.done
        assert landed == 2 and session.queued == 8
        await anyio.sleep(0.1)
        assert (session.stats.done, session.in_flight) == (landed, 0)
        session.resume()
        with anyio.fail_after(10):
            await session.drain()
        assert session.stats.done == 10 and session.buffered == 10
        session.close()
        records = [record async for record in session]
    assert sorted(r.id for r in records) == sorted(str(j.id) for j in jobs_for(Guess, "guess", 10))
    assert all(r.status != "failed" for r in records)


class FailsFirst(Env):
    """Its first episode breaks in ``reset`` (an env error); the others play along."""

    resets = 0

    def reset(self, seed: int) -> str:
        FailsFirst.resets += 1
        if FailsFirst.resets == 1:
            raise RuntimeError("the dataset row is corrupt")
        return f"Say hello ({seed})."

    def reward(self, answer: str) -> float:
        return 1.0


async def test_a_group_with_a_failed_sample_is_complete_and_says_which() -> None:
    FailsFirst.resets = 0
    config = EngineConfig(concurrency=1)  # in order: the very first sample fails
    async with (
        emulated_engine(["hello"], config=config) as (engine, _),
        RolloutSession(engine) as session,
    ):
        jobs = jobs_for(FailsFirst, "fails", 6, samples_per_prompt=3, seed=7)
        session.submit(jobs)
        session.close()
        groups = [group async for group in session.groups()]
    check_groups(groups, jobs)
    first, second = groups
    assert first.id == jobs[0].group_id and second.id == jobs[3].group_id
    assert [r.sample for r in first.failed] == [0]
    assert first.failed[0].stop_reason == "env_error"
    assert [r.sample for r in first.ok] == [1, 2] and len(second.ok) == 3


async def test_cancel_records_the_flight_and_returns_the_queue() -> None:
    slow = LatencyModel(prefill_s_per_token=0.0, step_base_s=0.002)
    async with (
        emulated_engine(latency=slow, config=EngineConfig(concurrency=3)) as (engine, _),
        RolloutSession(engine) as session,
    ):
        session.submit(jobs_for(Guess, "guess", 20))
        await until(lambda: session.in_flight >= 3)
        dropped = session.cancel()
        records = [record async for record in session]
        with pytest.raises(RuntimeError, match="open session"):
            session.submit(jobs_for(Guess, "guess", 1, step=1))
    cancelled = [r for r in records if r.stop_reason == "cancelled"]
    assert len(cancelled) == 3 and all(r.status == "failed" for r in cancelled)
    assert all(r.status != "failed" for r in records if r not in cancelled)
    assert len(records) + len(dropped) == 20
    assert {r.id for r in records}.isdisjoint(str(job.id) for job in dropped)


async def test_leaving_the_block_records_what_still_runs() -> None:
    slow = LatencyModel(prefill_s_per_token=0.0, step_base_s=0.002)
    async with emulated_engine(latency=slow, config=EngineConfig(concurrency=2)) as (engine, _):
        async with RolloutSession(engine) as session:
            session.submit(jobs_for(Guess, "guess", 4))
            await until(lambda: session.in_flight >= 2)
        left = session.unread()
    assert [r.stop_reason for r in left] == ["cancelled", "cancelled"]


# ----------------------------------------------------------------------- tasks


class Quiz(Env):
    """Driven by a dataset: the question comes in the task's payload."""

    def reset(self, task: Task) -> str:
        assert task.payload is not None
        self.answer = str(task.payload["answer"])
        return str(task.payload["question"])

    def reward(self, answer: str) -> float:
        return float(self.answer in answer)


async def test_an_env_can_take_the_task_and_its_payload() -> None:
    rows = [{"question": "Say 42.", "answer": 42}, {"question": "Say 7.", "answer": 7}]
    tasks = [Task(TaskId("quiz", f"row-{i}"), i, row) for i, row in enumerate(rows)]
    async with (
        emulated_engine(["The answer is 42."]) as (engine, _),
        RolloutSession(engine) as session,
    ):
        session.submit(jobs_of(Quiz, tasks, samples_per_prompt=2, step=3))
        session.close()
        groups = sorted([group async for group in session.groups()], key=lambda g: g.id)
    assert [group.id for group in groups] == [GroupId(3, task.id) for task in tasks]
    first = groups[0].records[0]
    assert first.messages[0].content == "Say 42." and first.task_id == "quiz/row-0"
    assert [r.reward for g in groups for r in g.records] == [1.0, 1.0, 0.0, 0.0]
    assert first.sampling.temperature == engine.config.sampling.temperature
