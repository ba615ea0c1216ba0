"""A turn that a pause in abort mode cuts short, or that reaches its route's quantum, goes
on, on the same server or another: emulated servers on real ports, paused and resumed
through their HTTP routes."""

from __future__ import annotations

from collections.abc import Iterator

import anyio
import httpx
import pytest

from libra.emulation import EmulatorConfig, LatencyModel, running_emulator
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
from libra.fleet import Api, Endpoint
from libra.sched import Router, RouteRequest
from libra.sched.policies import Choice, LeastLoadedScheduler, RoundRobin, Track
from tests._helpers import MODEL, assert_tokens_consistent

pytestmark = pytest.mark.anyio

TEXT = "Every token of this reply is sampled one decode step after the other. " * 6
SLOW = LatencyModel(
    prefill_s_per_token=0.0, step_base_s=0.005, step_per_seq_s=0.0, step_per_ctx_token_s=0.0
)  # the echoed reply (420 tokens) takes ~2 s


class Dictation(Env):
    """Asks for a long reply (the echo script repeats it) and ends after it."""

    max_turns = 2

    def reset(self, seed: int) -> str:
        return TEXT

    def reward(self, answer: str) -> float:
        return float(answer == TEXT)


JOB = TrajectoryJob.seeded(Dictation, "dictation", 0)


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    """A server the tests share: each leaves it resumed."""
    with running_emulator(EmulatorConfig(script="echo", latency=SLOW)) as url:
        yield url


@pytest.fixture
def other_url() -> Iterator[str]:
    """A server of the test's own (it may stay paused)."""
    with running_emulator(EmulatorConfig(script="echo", latency=SLOW)) as url:
        yield url


async def gauge(url: str, name: str) -> float:
    async with httpx.AsyncClient() as client:
        text = (await client.get(f"{url}/metrics")).text
    line = next(line for line in text.splitlines() if line.startswith(f"vllm:{name}{{"))
    return float(line.split()[-1])


async def until(url: str, name: str, value: float) -> None:
    with anyio.fail_after(10):
        while await gauge(url, name) != value:  # noqa: ASYNC110 (another process's state)
            await anyio.sleep(0.02)


async def control(url: str, path: str) -> None:
    async with httpx.AsyncClient() as client:
        response = await client.post(f"{url}{path}")
    assert response.status_code == 200, response.text


async def abort_mid_turn(url: str) -> None:
    """Pause ``url`` in abort mode once its request has generated for a while."""
    await until(url, "num_requests_running", 1)
    await anyio.sleep(0.4)
    await control(url, "/pause?mode=abort")


def engine_on(http: HTTPTransport, *endpoints: Endpoint, max_continuations: int = 8) -> Engine:
    # Seeded: a seedless request draws its own reply, and these compare two runs' replies.
    config = EngineConfig(max_continuations=max_continuations, sampling=SamplingConfig(seed=0))
    return Engine(http, LeastLoadedScheduler(list(endpoints)), config=config)


async def reference(url: str, api: Api = "tokens") -> TrajectoryRecord:
    """The same trajectory, uninterrupted."""
    async with http_transport("httpx") as http:
        return await run_trajectory(JOB, engine_on(http, Endpoint(url, model=MODEL, api=api)))


def assert_one_whole_turn(record: TrajectoryRecord, uninterrupted: TrajectoryRecord) -> None:
    assert (record.status, record.stop_reason, record.reward) == ("completed", "model_stop", 1.0)
    assert record.turns == 1
    assert [m.role for m in record.messages] == ["user", "assistant"]
    assert record.messages[-1].content == TEXT
    assert record.token_ids == uninterrupted.token_ids
    assert record.loss_mask == uninterrupted.loss_mask
    assert record.logprobs == uninterrupted.logprobs
    assert_tokens_consistent(record, [])
    # The spans cover exactly the one span of the uninterrupted turn, without a gap.
    (whole,) = uninterrupted.weight_versions
    assert record.weight_versions[0].start == whole.start
    assert record.weight_versions[-1].end == whole.end
    for before, after in zip(record.weight_versions, record.weight_versions[1:], strict=False):
        assert before.end == after.start


async def test_an_aborted_turn_continues_after_resume(url: str) -> None:
    uninterrupted = await reference(url)
    endpoint = Endpoint(url, model=MODEL, api="tokens", name="a")
    async with http_transport("httpx") as http:
        engine = engine_on(http, endpoint)
        records: list[TrajectoryRecord] = []

        async def run() -> None:
            records.append(await run_trajectory(JOB, engine))

        async with anyio.create_task_group() as group:
            group.start_soon(run)
            await abort_mid_turn(url)
            await until(url, "num_requests_waiting", 1)  # the continuation, held by the pause
            await control(url, "/resume")
    (record,) = records
    assert_one_whole_turn(record, uninterrupted)
    assert [span.version for span in record.weight_versions] == [0, 0]
    assert record.endpoints == ["a"]
    assert engine.scheduler.calls_in_flight() == {"a": 0}


async def test_a_continuation_moves_to_another_server(url: str, other_url: str) -> None:
    uninterrupted = await reference(url)
    first = Endpoint(other_url, model=MODEL, api="tokens", name="a", weight_version=3)
    second = Endpoint(url, model=MODEL, api="tokens", name="b", weight_version=4)
    async with http_transport("httpx") as http:
        engine = engine_on(http, first, second)
        scheduler = engine.scheduler
        assert isinstance(scheduler, LeastLoadedScheduler)
        records: list[TrajectoryRecord] = []

        async def run() -> None:
            records.append(await run_trajectory(JOB, engine))

        async with anyio.create_task_group() as group:
            group.start_soon(run)
            await until(other_url, "num_requests_running", 1)  # the first call went to "a"
            scheduler.router.drain("a")  # routing sends nothing new there
            await abort_mid_turn(other_url)
    (record,) = records
    assert_one_whole_turn(record, uninterrupted)
    # Which weights sampled which tokens: "a"'s up to the abort, "b"'s after it.
    assert [span.version for span in record.weight_versions] == [3, 4]
    assert record.endpoints == ["b"]
    assert scheduler.calls_in_flight() == {"a": 0, "b": 0}


async def test_on_the_chat_path_an_aborted_turn_starts_over(url: str) -> None:
    uninterrupted = await reference(url, api="chat")
    endpoint = Endpoint(url, model=MODEL, api="chat", name="a")
    async with http_transport("httpx") as http:
        engine = engine_on(http, endpoint)
        records: list[TrajectoryRecord] = []

        async def run() -> None:
            records.append(await run_trajectory(JOB, engine))

        async with anyio.create_task_group() as group:
            group.start_soon(run)
            await abort_mid_turn(url)
            await until(url, "num_requests_waiting", 1)
            await control(url, "/resume")
    (record,) = records
    assert_one_whole_turn(record, uninterrupted)
    assert len(record.weight_versions) == 1  # the partial reply was dropped, not joined


@pytest.mark.faults
async def test_a_server_that_keeps_aborting_fails_the_trajectory_as_a_server_error(
    url: str,
) -> None:
    endpoint = Endpoint(url, model=MODEL, api="tokens", name="a")
    async with http_transport("httpx") as http:
        engine = engine_on(http, endpoint, max_continuations=1)
        records: list[TrajectoryRecord] = []

        async def run() -> None:
            records.append(await run_trajectory(JOB, engine))

        async with anyio.create_task_group() as group:
            group.start_soon(run)
            for _ in range(2):
                await abort_mid_turn(url)
                await control(url, "/resume")
    (record,) = records
    assert (record.status, record.stop_reason) == ("failed", "server_error")
    assert "aborted 2 times" in (record.error or "")
    assert record.turns == 0


class InQuanta(RoundRobin):
    """Round robin over the endpoints, every call cut at ``quantum`` tokens."""

    def __init__(self, endpoints: list[Endpoint], quantum: int) -> None:
        super().__init__(Router.over(endpoints))
        self.quantum = quantum
        self.requests: list[RouteRequest] = []

    def choose(self, request: RouteRequest, track: Track, exclude: frozenset[str]) -> Choice:
        self.requests.append(request)
        return super().choose(request, track, exclude)._replace(max_tokens=self.quantum)


async def test_a_turn_cut_at_its_quantum_goes_on_through_routing(url: str, other_url: str) -> None:
    uninterrupted = await reference(url)
    first = Endpoint(url, model=MODEL, api="tokens", name="a", weight_version=3)
    second = Endpoint(other_url, model=MODEL, api="tokens", name="b", weight_version=4)
    scheduler = InQuanta([first, second], quantum=100)
    async with http_transport("httpx") as http:
        config = EngineConfig(max_continuations=0, sampling=SamplingConfig(seed=0))
        record = await run_trajectory(JOB, Engine(http, scheduler, config=config))
    assert_one_whole_turn(record, uninterrupted)
    # The reply's 421 tokens in calls of 100, each routed again (so in turn on "a" and
    # "b"); quanta are not restarts: max_continuations=0 allows none.
    assert [request.generated_tokens for request in scheduler.requests] == [0, 100, 200, 300, 400]
    assert [request.turn for request in scheduler.requests] == [0] * 5
    assert [span.version for span in record.weight_versions] == [3, 4, 3, 4, 3]
    assert [span.end - span.start for span in record.weight_versions] == [100] * 4 + [21]
    assert scheduler.calls_in_flight() == {"a": 0, "b": 0}


class StoppingDictation(Dictation):
    stop_strings = ("THE END",)  # the reply never says it


async def test_a_turn_with_stop_strings_is_never_cut_at_a_quantum(url: str) -> None:
    """A stop string could straddle two calls, where the server would not see it."""
    scheduler = InQuanta([Endpoint(url, model=MODEL, api="tokens", name="a")], quantum=100)
    job = TrajectoryJob.seeded(StoppingDictation, "dictation", 0)
    async with http_transport("httpx") as http:
        engine = Engine(http, scheduler, config=EngineConfig(sampling=SamplingConfig(seed=0)))
        record = await run_trajectory(job, engine)
    assert (record.status, record.messages[-1].content) == ("completed", TEXT)
    assert len(scheduler.requests) == 1


async def test_on_the_chat_path_a_turn_is_never_cut_at_a_quantum(url: str) -> None:
    uninterrupted = await reference(url, api="chat")
    scheduler = InQuanta([Endpoint(url, model=MODEL, api="chat", name="a")], quantum=100)
    async with http_transport("httpx") as http:
        engine = Engine(http, scheduler, config=EngineConfig(sampling=SamplingConfig(seed=0)))
        record = await run_trajectory(JOB, engine)
    assert_one_whole_turn(record, uninterrupted)
    assert len(scheduler.requests) == 1  # a chat reply cannot be continued: one call
