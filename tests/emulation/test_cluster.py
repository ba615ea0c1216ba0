"""The emulated cluster, in virtual time: instances that cost their start, serve, and are
cut when stopped; training operations at the trainer's costs; injected faults."""

from __future__ import annotations

from typing import Any

import anyio
import httpx
import pytest
from trio.testing import MockClock

from libra.alloc import Cluster
from libra.emulation import EmulatedCluster, InstanceStartFailed, TrainJoinFailed
from tests._helpers import MODEL, SMALL_MODEL, emulated_cluster

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, Any]]:
    """Trio with a clock that jumps whenever every task sleeps: virtual time."""
    return "trio", {"clock": MockClock(autojump_threshold=0)}


def client_of(cluster: EmulatedCluster) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=cluster.fleet))


async def test_an_instance_answers_once_started_and_is_gone_once_stopped() -> None:
    emulated = emulated_cluster(start_s=25.0)
    cluster: Cluster = emulated  # what the pool drives
    started = anyio.current_time()
    url = await cluster.start_instance("w1", (1,))
    assert anyio.current_time() - started == pytest.approx(25.0)
    assert url == "http://w1"
    async with client_of(emulated) as client:
        models = (await client.get(f"{url}/v1/models")).json()
        assert [model["id"] for model in models["data"]] == [MODEL]
        await cluster.stop_instance("w1")
        with pytest.raises(ConnectionRefusedError):
            await client.get(f"{url}/v1/models")


async def test_workers_in_use_take_no_other_instance() -> None:
    cluster = emulated_cluster()
    await cluster.start_instance("w1-2", (1, 2))
    with pytest.raises(ValueError, match="busy"):
        await cluster.start_instance("w2", (2,))
    await cluster.activate(3)
    with pytest.raises(ValueError, match="busy"):
        await cluster.start_instance("w3", (3,))
    with pytest.raises(ValueError, match="no worker 9"):
        await cluster.start_instance("w9", (9,))
    await cluster.stop_instance("w1-2")
    assert await cluster.start_instance("w2", (2,)) == "http://w2"


async def test_stopping_an_instance_cuts_the_call_it_serves() -> None:
    cluster = emulated_cluster(start_s=0.0)
    url = await cluster.start_instance("w1", (1,))
    cut: list[BaseException] = []
    body = {"model": MODEL, "messages": [{"role": "user", "content": "think"}]}

    async def call(client: httpx.AsyncClient) -> None:
        try:
            await client.post(f"{url}/v1/chat/completions", json=body)
        except ConnectionResetError as error:
            cut.append(error)

    async with client_of(cluster) as client, anyio.create_task_group() as group:
        group.start_soon(call, client)
        await anyio.sleep(0.1)  # a reply of 40 tokens or more takes 0.4 s
        assert cluster.fleet.serving("w1") == 1
        await cluster.stop_instance("w1")
    assert len(cut) == 1 and "stopped during the call" in str(cut[0])
    assert cluster.fleet.serving("w1") == 0 and cluster.placement == {}


async def test_a_failing_start_fails_once_and_frees_its_workers() -> None:
    cluster = emulated_cluster(start_s=10.0)
    cluster.fail_next_start(2)
    with pytest.raises(InstanceStartFailed):
        await cluster.start_instance("w1-2", (1, 2))
    assert cluster.placement == {}
    assert await cluster.start_instance("w1-2", (1, 2)) == "http://w1-2"


async def test_a_join_costs_the_truth_and_its_faults_fail_or_hang() -> None:
    cluster = emulated_cluster()
    truth = cluster.trainer.truth
    fetch_s = SMALL_MODEL.parameters * truth.state_bytes_per_param / truth.link_bytes_per_s
    started = anyio.current_time()
    for operation in (cluster.fetch_state, cluster.zero_sync, cluster.activate):
        await operation(3)
    assert anyio.current_time() - started == pytest.approx(
        fetch_s + truth.zero_sync_s + truth.activate_s
    )
    assert cluster.trainer.active == {3}
    await cluster.leave_training(3)
    assert cluster.trainer.active == set()

    cluster.fail_next_join(2)
    with pytest.raises(TrainJoinFailed):
        await cluster.fetch_state(2)
    await cluster.fetch_state(2)  # only the next join fails

    cluster.hang_next_join(2)
    with anyio.move_on_after(1e6) as waited:
        await cluster.fetch_state(2)
    assert waited.cancelled_caught
    await cluster.fetch_state(2)
