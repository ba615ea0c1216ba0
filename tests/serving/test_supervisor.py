"""The supervisor against real server processes on loopback, mid-rollout: a server that is
killed or hangs leaves routing at once, comes back on its address with the run's current
weights, and every trajectory still ends in exactly one record, with exact tokens."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import pytest

from envs_contrib.calc import Calc
from libra.emulation import AgentScript, EmulatorConfig, EmulatorServer, LatencyModel
from libra.engine import Engine, EngineConfig, TrajectoryRecord, http_transport, jobs_for, rollout
from libra.fleet import BucketSpec, FleetSpec, InstanceSpec
from libra.sched.policies import make_policy
from libra.serving import WEIGHTS_FILE, ServerSupervisor, SupervisorConfig
from tests._helpers import MODEL, assert_tokens_consistent

pytestmark = [pytest.mark.anyio, pytest.mark.faults]

SLOW = LatencyModel(prefill_s_per_token=1e-6, step_base_s=0.01, step_per_seq_s=1e-5)
QUICK_PROBES = SupervisorConfig(probe_interval_s=0.2, probe_timeout_s=0.3, hung_after=2)


@asynccontextmanager
async def two_servers() -> AsyncIterator[dict[str, EmulatorServer]]:
    config = EmulatorConfig(
        model_name=MODEL, latency=SLOW, agent=AgentScript(think_tokens=(40, 120))
    )
    servers = {name: EmulatorServer(config) for name in "ab"}
    async with AsyncExitStack() as stack:
        for server in servers.values():
            await server.astart()
            stack.push_async_callback(server.astop)
        yield servers


def fleet_of(servers: dict[str, EmulatorServer]) -> FleetSpec:
    instances = [
        InstanceSpec(name=name, url=server.url, model=MODEL, api="tokens")
        for name, server in servers.items()
    ]
    return FleetSpec(
        instances=instances,
        buckets=[BucketSpec(name="all", max_tokens=16_000, instances=["a", "b"])],
    )


def check_every_job_once(records: list[TrajectoryRecord], n: int) -> None:
    assert len(records) == n and len({r.id for r in records}) == n
    for record in records:
        assert record.status != "failed", (record.stop_reason, record.error)
        assert record.tokens == "exact"
        assert_tokens_consistent(record, Calc.tool_schemas())


async def until(condition: object, timeout_s: float = 30.0) -> None:
    assert callable(condition)
    with anyio.fail_after(timeout_s):
        while not condition():  # noqa: ASYNC110 (polls counters nothing signals)
            await anyio.sleep(0.01)


@dataclass
class Broadcast:
    """Weights a collective transport sent: on disk only once a restart asks."""

    folder: Path
    asked: list[int] = field(default_factory=list)

    def __call__(self) -> tuple[Path | None, int]:
        return None, 3

    async def on_disk(self, version: int) -> Path:
        self.asked.append(version)
        return self.folder


@pytest.mark.parametrize(
    ("fault", "sent"), [("killed", "disk"), ("hung", "disk"), ("killed", "broadcast")]
)
async def test_a_lost_server_comes_back_with_the_current_weights(
    fault: str, sent: str, tmp_path: Path
) -> None:
    (tmp_path / WEIGHTS_FILE).write_bytes(b"")  # the emulator reloads nothing from it
    broadcast = Broadcast(tmp_path)
    weights = broadcast if sent == "broadcast" else lambda: (tmp_path, 3)
    jobs = jobs_for(Calc, "calc", 40)
    records: list[TrajectoryRecord] = []
    async with two_servers() as servers:
        policy = make_policy("cmlfq", fleet_of(servers))
        router = policy.router
        supervisor = ServerSupervisor(router, servers, weights=weights, config=QUICK_PROBES)
        config = EngineConfig(concurrency=40, retry_backoff_s=0.05, call_timeout_s=2.0)
        async with http_transport("httpx") as http, anyio.create_task_group() as group:
            group.start_soon(supervisor.run)
            engine = Engine(http, policy, config=config, on_record=records.append)
            async with anyio.create_task_group() as run:
                run.start_soon(rollout, jobs, engine)
                await until(lambda: router.by_name["b"].in_flight > 0 and len(records) >= 2)
                servers["b"].kill() if fault == "killed" else servers["b"].hang()
                await until(lambda: router.by_name["b"].marked_down)
                await until(lambda: not router.by_name["b"].marked_down)
                assert len(records) < len(jobs)  # it came back mid-rollout
            group.cancel_scope.cancel()
    check_every_job_once(records, len(jobs))
    kinds = [event.kind for event in supervisor.events]
    assert kinds == ["died" if fault == "killed" else "hung", "restarted"]
    assert servers["b"].starts == 2
    assert router.by_name["b"].endpoint.weight_version == 3
    assert broadcast.asked == ([3] if sent == "broadcast" else [])
    # Turns went to b again after its restart, on the weights it was given (a stays on v0).
    assert any(span.version == 3 for r in records for span in r.weight_versions)


async def test_a_server_that_will_not_start_again_is_given_up() -> None:
    jobs = jobs_for(Calc, "calc", 24)
    records: list[TrajectoryRecord] = []
    config = SupervisorConfig(
        probe_interval_s=0.2, probe_timeout_s=0.3, max_restarts=2, backoff_s=0.05
    )
    async with two_servers() as servers:
        policy = make_policy("cmlfq", fleet_of(servers))
        router = policy.router
        supervisor = ServerSupervisor(router, servers, config=config)
        engine_config = EngineConfig(concurrency=24, retry_backoff_s=0.05)
        async with http_transport("httpx") as http, anyio.create_task_group() as group:
            group.start_soon(supervisor.run)
            engine = Engine(http, policy, config=engine_config, on_record=records.append)
            async with anyio.create_task_group() as run:
                run.start_soon(rollout, jobs, engine)
                await until(lambda: router.by_name["b"].in_flight > 0)
                servers["b"].startup_timeout_s = 1e-3  # no start will be healthy in time
                servers["b"].kill()
                await until(lambda: "b" not in router.by_name)
            group.cancel_scope.cancel()
    check_every_job_once(records, len(jobs))
    kinds = [event.kind for event in supervisor.events]
    assert kinds == ["died", "restart_failed", "restart_failed", "gave_up"]
    assert all(r.endpoints[-1] == "a" for r in records)


async def test_with_its_only_server_down_the_rollout_waits_for_the_restart() -> None:
    jobs = jobs_for(Calc, "calc", 16)
    records: list[TrajectoryRecord] = []
    async with two_servers() as servers:
        only = {"a": servers["a"]}
        spec = FleetSpec(
            instances=[InstanceSpec(name="a", url=only["a"].url, model=MODEL, api="tokens")]
        )
        policy = make_policy("cmlfq", spec)
        supervisor = ServerSupervisor(policy.router, only, config=QUICK_PROBES)
        config = EngineConfig(concurrency=16, retry_backoff_s=0.05)
        async with http_transport("httpx") as http, anyio.create_task_group() as group:
            group.start_soon(supervisor.run)
            engine = Engine(http, policy, config=config, on_record=records.append)
            async with anyio.create_task_group() as run:
                run.start_soon(rollout, jobs, engine)
                await until(lambda: policy.router.by_name["a"].in_flight > 0)
                only["a"].kill()
            group.cancel_scope.cancel()
    check_every_job_once(records, len(jobs))
    assert [event.kind for event in supervisor.events] == ["died", "restarted"]


async def test_a_server_watched_later_is_restarted_and_one_unwatched_is_left_stopped() -> None:
    """The allocation pool's servers: started after the run began, stopped on purpose."""
    async with two_servers() as servers:
        router = make_policy("cmlfq", fleet_of(servers)).router
        supervisor = ServerSupervisor(router, {"a": servers["a"]}, config=QUICK_PROBES)
        async with anyio.create_task_group() as group:
            group.start_soon(supervisor.run)
            supervisor.watch("b", servers["b"])
            servers["b"].kill()
            await until(lambda: [e.kind for e in supervisor.events] == ["died", "restarted"])
            assert servers["b"].starts == 2 and not router.by_name["b"].marked_down
            supervisor.unwatch("b")
            await servers["b"].astop()  # its owner stops it: no fault
            await anyio.sleep(5 * (QUICK_PROBES.probe_interval_s + QUICK_PROBES.probe_timeout_s))
            assert servers["b"].starts == 2 and len(supervisor.events) == 2
            assert not router.by_name["b"].marked_down
            servers["a"].kill()  # the one watched from the start still is
            await until(lambda: len(supervisor.events) == 4)
            group.cancel_scope.cancel()
    assert [(e.instance, e.kind) for e in supervisor.events] == [
        ("b", "died"),
        ("b", "restarted"),
        ("a", "died"),
        ("a", "restarted"),
    ]
