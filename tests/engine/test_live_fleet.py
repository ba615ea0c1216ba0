"""A rollout over a live fleet: instances drain, leave, die and join while trajectories
run, and every trajectory still ends in exactly one record, with exact tokens."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager

import anyio
import pytest

from envs_contrib.calc import Calc
from libra.emulation import (
    AgentScript,
    EmulatorConfig,
    EmulatorProcess,
    LatencyModel,
    emulator_process,
)
from libra.engine import (
    Engine,
    EngineConfig,
    TrajectoryRecord,
    http_transport,
    jobs_for,
    rollout,
)
from libra.fleet import BucketSpec, FleetSpec, InstanceSpec
from libra.sched import Router
from libra.sched.policies import RoutedPolicy, make_policy
from tests._helpers import MODEL, assert_tokens_consistent, emulated_engine

pytestmark = pytest.mark.anyio

# Turns of 40-120 tokens at ~10 ms a step: calls stay in flight long enough to act on.
SLOW = LatencyModel(prefill_s_per_token=1e-6, step_base_s=0.01, step_per_seq_s=1e-5)
THINKING = AgentScript(think_tokens=(40, 120))


@contextmanager
def three_servers() -> Iterator[dict[str, EmulatorProcess]]:
    config = EmulatorConfig(model_name=MODEL, latency=SLOW, agent=THINKING)
    with ExitStack() as stack:
        yield {name: stack.enter_context(emulator_process(config)) for name in "abc"}


def fleet_of(servers: dict[str, EmulatorProcess]) -> FleetSpec:
    return FleetSpec(
        instances=[
            InstanceSpec(name=name, url=server.url, model=MODEL, api="tokens")
            for name, server in servers.items()
        ],
        buckets=[
            BucketSpec(name="short", max_tokens=2_000, instances=["a", "b"]),
            BucketSpec(name="long", max_tokens=16_000, instances=["c"]),
        ],
    )


async def until(condition: Callable[[], bool], timeout_s: float = 20.0) -> None:
    with anyio.fail_after(timeout_s):
        while not condition():  # noqa: ASYNC110 (polls counters nothing signals)
            await anyio.sleep(0.005)


def check_every_job_once(records: list[TrajectoryRecord], n: int) -> None:
    assert len(records) == n and len({r.id for r in records}) == n
    for record in records:
        assert record.status != "failed", (record.stop_reason, record.error)
        assert record.tokens == "exact"
        assert_tokens_consistent(record, Calc.tool_schemas())
        replies = sum(m.role == "assistant" for m in record.messages)
        assert replies == record.turns == len(record.endpoints)  # no turn lost or doubled


def assert_forgotten(policy: RoutedPolicy, gone: set[str]) -> None:
    router = policy.router
    assert not gone & set(router.by_name) and not gone & set(router.endpoints())
    assert all(i.name not in gone for b in router.buckets for i in b.instances)
    assert all(i.name not in gone for i in router.home.values())
    assert all(t.instance is None or t.instance.name not in gone for t in policy.tracks.values())
    assert not gone & set(policy.calls_in_flight())


def between_turns_on(router: Router, name: str) -> bool:
    """Some trajectory's last turn returned on ``name`` and it is in a tool call now: its
    next turn must run elsewhere once ``name`` is gone."""
    instance = router.by_name[name]
    return len(instance.residents) > instance.in_flight


@pytest.mark.faults
@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # three server processes: one backend
async def test_drain_remove_and_a_killed_server_mid_rollout_lose_nothing() -> None:
    jobs = jobs_for(Calc, "calc", 48)
    records: list[TrajectoryRecord] = []
    with three_servers() as servers:
        policy = make_policy("cmlfq", fleet_of(servers))
        router = policy.router
        config = EngineConfig(concurrency=48, retry_backoff_s=0.05)
        async with http_transport("httpx") as http:
            engine = Engine(http, policy, config=config, on_record=records.append)
            async with anyio.create_task_group() as group:
                group.start_soon(rollout, jobs, engine)
                await until(
                    lambda: (
                        len(records) >= 4
                        and all(router.by_name[n].in_flight for n in "ab")
                        and between_turns_on(router, "b")
                    )
                )
                draining = router.by_name["a"].in_flight
                killed = router.by_name["b"].in_flight
                drained = router.drain("a")
                servers["b"].kill()  # gone at once, its calls cut mid-turn
                await drained.wait()
                router.remove("a")
                await until(lambda: router.by_name["b"].failures > 0)
                router.remove("b", force=True)  # what a supervisor does once it notices
                assert_forgotten(policy, {"a", "b"})
                assert len(records) < len(jobs)  # all this happened mid-rollout
    assert draining > 0 and killed > 0
    check_every_job_once(records, len(jobs))
    # Turns that ran on a or b before it left went on elsewhere (a cut call is not listed:
    # only turns that returned are).
    assert any("a" in r.endpoints and r.endpoints[-1] != "a" for r in records)
    assert any("b" in r.endpoints and r.endpoints[-1] != "b" for r in records)
    assert_forgotten(policy, {"a", "b"})
    assert policy.calls_in_flight() == {"c": 0} and policy.tracks == {} and router.home == {}


SHORT_TURNS = LatencyModel(prefill_s_per_token=0.0, step_base_s=0.002)


async def test_an_emptied_fleet_waits_for_an_instance_to_join() -> None:
    async with emulated_engine(
        config=EngineConfig(concurrency=8), latency=SHORT_TURNS, agent=THINKING
    ) as (engine, records):
        router: Router = engine.scheduler.router
        (only,) = router.instances
        async with anyio.create_task_group() as group:
            group.start_soon(rollout, jobs_for(Calc, "calc", 16), engine)
            await until(lambda: only.in_flight > 0)
            await router.retire(only.name)  # the fleet is empty: a reallocation
            await anyio.sleep(0.3)
            assert len(records) < 16
            joined = InstanceSpec(name="joined", url=only.endpoint.url, model=MODEL)
            router.add_instance(joined, "all")
    check_every_job_once(records, 16)
    assert any(r.endpoints[0] == only.name and r.endpoints[-1] == "joined" for r in records)


@pytest.mark.faults
async def test_no_capacity_in_time_is_a_server_error() -> None:
    config = EngineConfig(concurrency=4, capacity_wait_s=0.2)
    async with emulated_engine(config=config, latency=SHORT_TURNS, agent=THINKING) as (
        engine,
        records,
    ):
        router: Router = engine.scheduler.router
        (only,) = router.instances
        async with anyio.create_task_group() as group:
            group.start_soon(rollout, jobs_for(Calc, "calc", 4), engine)
            await until(lambda: only.in_flight > 0)
            await router.retire(only.name)
    assert len(records) == 4
    failed = [r for r in records if r.status == "failed"]
    assert failed and all(r.stop_reason == "server_error" for r in failed)
    assert all("no endpoint" in (r.error or "") for r in failed)


async def test_a_weight_sync_mid_call_keeps_the_routed_version_and_is_counted() -> None:
    async with emulated_engine(
        config=EngineConfig(concurrency=8), latency=SHORT_TURNS, agent=THINKING
    ) as (engine, records):
        router: Router = engine.scheduler.router
        (endpoint,) = router.endpoints().values()
        async with anyio.create_task_group() as group:
            group.start_soon(rollout, jobs_for(Calc, "calc", 8), engine)
            await until(lambda: router.instances[0].in_flight > 0)
            in_flight = router.instances[0].in_flight
            endpoint.weight_version = 1  # what a weight sync does to the shared registry
    check_every_job_once(records, 8)
    assert sum(r.weights_changed_turns for r in records) == in_flight
    for record in records:
        versions = [span.version for span in record.weight_versions]
        assert versions == sorted(versions)  # routed before the sync: 0; after: 1
        if record.weights_changed_turns:
            assert versions[0] == 0
    assert all(r.weight_versions[-1].version == 1 for r in records if r.turns > 1)


async def test_a_rejected_request_fails_its_trajectory_but_not_the_server() -> None:
    async with emulated_engine(max_model_len=64) as (engine, records):  # prompts do not fit
        await rollout(jobs_for(Calc, "calc", 3), engine)
    # Refused as too long for the model: the prompt's fault, neither the server's nor the model's.
    assert [(r.status, r.stop_reason) for r in records] == [("failed", "prompt_too_long")] * 3
    (instance,) = engine.scheduler.router.instances
    assert instance.failures == 0 and not instance.is_down(engine.scheduler.router.clock())
