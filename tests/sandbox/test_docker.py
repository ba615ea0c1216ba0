"""Docker sandboxes: the warm pool resets and replaces, the reaper reaps, the settings hold.

What every provider must do (limits, timeouts, network...) is in test_sandbox_contract.py.
Skipped only when no Docker engine is reachable (start one with scripts/ensure-docker.sh).
One provider and one spec serve the module, so containers (~1-3 s each to start on the vfs
storage driver) are reused across tests exactly as across trajectories.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import signal
import socket
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
import pytest

from libra.envs import SandboxError, SandboxSpec
from libra.sandbox import DockerSandboxProvider, reap_stale_containers
from tests._helpers import LIST_PROCESSES

if TYPE_CHECKING:
    import docker

docker_errors = pytest.importorskip("docker.errors", reason="the Docker SDK is not installed")

pytestmark = pytest.mark.anyio

ENSURE_DOCKER = Path(__file__).resolve().parents[2] / "scripts" / "ensure-docker.sh"

SPEC = SandboxSpec(memory_mb=128, pids=64, workdir_size_mb=16, output_limit_bytes=4096)


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    # Docker's SDK runs in worker threads either way; one backend keeps one module-wide loop.
    return "asyncio"


@pytest.fixture(scope="module")
async def provider(docker_client: docker.DockerClient) -> AsyncIterator[DockerSandboxProvider]:
    async with DockerSandboxProvider(pool_size=2, client=docker_client) as provider:
        yield provider


async def test_network_mode_follows_the_spec(
    provider: DockerSandboxProvider, docker_client: docker.DockerClient
) -> None:
    """What the contract's network test sees from inside, as the container's settings."""
    modes = []
    for network in (False, True):
        async with provider.sandbox(dataclasses.replace(SPEC, network=network)) as box:
            inspected = docker_client.api.inspect_container(box.container_id)
            modes.append(inspected["HostConfig"]["NetworkMode"])
    assert modes[0] == "none"
    assert modes[1] in {"bridge", "host"}  # "host" when the engine runs with --bridge=none


async def test_warm_pool_reuses_a_reset_container(provider: DockerSandboxProvider) -> None:
    async with provider.sandbox(SPEC) as first:
        await first.exec(
            [
                "sh",
                "-c",
                "echo a > /work/a; mkdir -p /work/d/e; chmod 500 /work/d; echo t > /tmp/t; "
                "echo s > /dev/shm/s; (sleep 600 >/dev/null 2>&1 &); "
                "setsid sleep 601 >/dev/null 2>&1 &",
            ],
            timeout_s=10,
        )
        await first.write_file("hidden", b"h", mode=0o600)
        first_id = first.container_id
    reused_before = provider.stats.reused
    async with provider.sandbox(SPEC) as second:
        assert second.container_id == first_id
        assert provider.stats.reused == reused_before + 1
        listing = await second.exec(["sh", "-c", "ls -A /work /tmp /dev/shm"], timeout_s=10)
        processes = await second.exec(LIST_PROCESSES, timeout_s=10)
    assert listing.stdout.split() == ["/dev/shm:", "/tmp:", "/work:"]
    assert "sleep 60" not in processes.stdout


async def test_a_container_that_cannot_be_reset_is_replaced(
    provider: DockerSandboxProvider, docker_client: docker.DockerClient
) -> None:
    async with provider.sandbox(SPEC) as box:
        broken_id = box.container_id
        docker_client.api.kill(broken_id)  # e.g. the engine killed it: the reset cannot run
        with pytest.raises(SandboxError):
            await box.exec(["true"], timeout_s=5)
    assert provider.stats.reset_failures >= 1
    async with provider.sandbox(SPEC) as box:
        assert box.container_id != broken_id
        assert (await box.exec(["echo", "fresh"], timeout_s=10)).stdout == "fresh\n"
    assert broken_id not in {c.id for c in docker_client.containers.list(all=True)}


@pytest.mark.faults
async def test_an_idle_container_found_stopped_is_replaced_when_handed_out(
    provider: DockerSandboxProvider, docker_client: docker.DockerClient
) -> None:
    await provider.prewarm(SPEC, 1)
    async with provider.sandbox(SPEC) as box:  # takes the warm one
        stopped_id = box.container_id
    docker_client.api.kill(stopped_id)  # idle in the pool: e.g. a daemon restart stopped it
    before = provider.stats.dead_on_handout
    async with provider.sandbox(SPEC) as box:
        assert box.container_id != stopped_id
        assert (await box.exec(["echo", "fresh"], timeout_s=10)).stdout == "fresh\n"
    assert provider.stats.dead_on_handout >= before + 1
    assert stopped_id not in {c.id for c in docker_client.containers.list(all=True)}


@pytest.mark.faults
async def test_a_container_killed_mid_call_is_a_sandbox_error_not_the_program_s_exit(
    provider: DockerSandboxProvider, docker_client: docker.DockerClient
) -> None:
    """Killed from outside (an operator, the OOM killer of the host, a daemon restart), the
    container takes the call with it: that is no exit status of the program."""
    async with provider.sandbox(SPEC) as box:
        killed_id = box.container_id

        async def kill_soon() -> None:
            await anyio.sleep(1.0)
            await anyio.to_thread.run_sync(docker_client.api.kill, killed_id)

        async with anyio.create_task_group() as group:
            group.start_soon(kill_soon)
            with pytest.raises(SandboxError, match="container died during the call"):
                await box.exec(["sleep", "30"], timeout_s=60)
    async with provider.sandbox(SPEC) as box:  # the pool replaced it
        assert box.container_id != killed_id
        assert (await box.exec(["echo", "fresh"], timeout_s=10)).stdout == "fresh\n"


async def test_a_program_killed_inside_a_live_container_is_its_exit_status(
    provider: DockerSandboxProvider,
) -> None:
    async with provider.sandbox(SPEC) as box:
        result = await box.exec(["sh", "-c", "kill -9 $$"], timeout_s=10)
    assert (result.exit_code, result.timed_out) == (137, False)


async def test_reaper_removes_containers_of_dead_owners(
    provider: DockerSandboxProvider, docker_client: docker.DockerClient
) -> None:
    await provider.prewarm(SPEC, 1)  # a live owner's container, which must survive
    async with await anyio.open_process(["true"]) as dead:
        await dead.wait()
    labels = {
        "libra.sandbox": "1",
        "libra.run": "test-reaper",
        "libra.host": socket.gethostname(),
        "libra.pid": str(dead.pid),
        "libra.pid_start": "1",  # no live process started then: stale even if the pid is reused
    }
    orphan = docker_client.containers.create("libra/python", ["sleep", "infinity"], labels=labels)
    try:
        reaped = reap_stale_containers(docker_client)
        remaining = {c.id for c in docker_client.containers.list(all=True)}
        assert orphan.id in reaped and orphan.id not in remaining
        ours = docker_client.containers.list(filters={"label": f"libra.run={provider.run_id}"})
        assert ours and all(c.id in remaining for c in ours)
        assert all(c.labels["libra.pid"] == str(os.getpid()) for c in ours)
    finally:
        with contextlib.suppress(docker_errors.NotFound):
            orphan.remove(force=True)


async def test_close_removes_a_container_of_its_run_that_it_never_learned_about(
    docker_client: docker.DockerClient,
) -> None:
    """A create request that timed out on our side may still have made its container:
    closing the provider finds it by the run's label."""
    async with DockerSandboxProvider(client=docker_client, reap_stale=False) as provider:
        async with provider.sandbox(SPEC) as box:
            assert (await box.exec(["true"], timeout_s=10)).exit_code == 0
        labels = {"libra.sandbox": "1", "libra.run": provider.run_id}
        unknown = docker_client.containers.create("libra/python", ["sleep", "inf"], labels=labels)
    remaining = docker_client.containers.list(all=True, filters={"label": "libra.run"})
    assert unknown.id not in {c.id for c in remaining}
    assert not [c for c in remaining if c.labels["libra.run"] == provider.run_id]


async def test_a_missing_image_says_how_to_build_it(docker_client: docker.DockerClient) -> None:
    async with DockerSandboxProvider(client=docker_client, reap_stale=False) as provider:
        with pytest.raises(SandboxError, match="build-image libra/does-not-exist"):
            async with provider.sandbox(SandboxSpec(image="libra/does-not-exist")):
                pass


def dockerd_pid() -> int | None:
    found = subprocess.run(["pidof", "dockerd"], capture_output=True, text=True).stdout.split()
    return int(found[0]) if found else None


def restart_docker_engine() -> None:
    """Stop the dockerd that scripts/ensure-docker.sh started (its containers die with it)
    and start it again the same way."""
    pid = int(
        subprocess.run(["pidof", "dockerd"], capture_output=True, text=True).stdout.split()[0]
    )
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 60
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        time.sleep(0.2)
    subprocess.run([str(ENSURE_DOCKER)], check=True, capture_output=True)


@pytest.mark.faults
# Last in the module: the restart stops the containers of the module's provider too.
@pytest.mark.slow
# docker-py 7.2 leaks the socket of a connect the stopped engine refused
# (docker/transport/unixconn.py, UnixHTTPConnection.connect): its ResourceWarning is theirs.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
async def test_a_docker_engine_restart_mid_run_is_survived(
    docker_client: docker.DockerClient,
) -> None:
    """Idle containers the restart stopped are replaced on hand-out; containers asked for
    while the engine is down wait for it; a lent one that died is the sandbox's failure."""
    if os.geteuid() != 0 or dockerd_pid() is None:
        pytest.skip("restarting the Docker engine needs root and a dockerd of our own")
    async with DockerSandboxProvider(pool_size=2, client=docker_client) as own:
        await own.prewarm(SPEC, 2)
        async with own.sandbox(SPEC) as lent:
            await anyio.to_thread.run_sync(restart_docker_engine)
            with pytest.raises(SandboxError):
                await lent.exec(["true"], timeout_s=5)
        # The pool: the lent one's replacement, and the idle one that died with the engine.
        async with own.sandbox(SPEC) as first, own.sandbox(SPEC) as second:
            for box in (first, second):
                assert (await box.exec(["echo", "back"], timeout_s=10)).stdout == "back\n"
        assert own.stats.dead_on_handout == 1

        async def restart_later() -> None:
            await anyio.sleep(0.5)
            await anyio.to_thread.run_sync(restart_docker_engine)

        async with anyio.create_task_group() as group:  # asked for while the engine is down
            group.start_soon(restart_later)
            await anyio.sleep(1.0)
            async with own.sandbox(SPEC) as waited:
                assert (await waited.exec(["echo", "waited"], timeout_s=10)).stdout == "waited\n"
    gc.collect()  # the leaked sockets' warnings fall here, where they are filtered
