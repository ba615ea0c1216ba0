"""Docker sandboxes: the limits hold, timeouts kill, the warm pool resets, the reaper reaps.

Skipped only when no Docker engine is reachable (start one with scripts/ensure-docker.sh).
One provider and one spec serve the module, so containers (~1-3 s each to start on the vfs
storage driver) are reused across tests exactly as across trajectories.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import anyio
import pytest

from libra.envs import SandboxError, SandboxSpec
from libra.sandbox import DockerSandboxProvider, reap_stale_containers
from tests._helpers import assert_hidden_file_is_unreadable

if TYPE_CHECKING:
    import docker

docker_errors = pytest.importorskip("docker.errors", reason="the Docker SDK is not installed")

pytestmark = pytest.mark.anyio

SPEC = SandboxSpec(memory_mb=128, pids=64, workdir_size_mb=16, output_limit_bytes=4096)
PS = [
    "sh",
    "-c",
    "for p in /proc/[0-9]*; do echo $(stat -c %U $p) $(cat $p/cmdline | tr '\\0' ' '); done",
]


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    # Docker's SDK runs in worker threads either way; one backend keeps one module-wide loop.
    return "asyncio"


@pytest.fixture(scope="module")
async def provider(docker_client: docker.DockerClient) -> AsyncIterator[DockerSandboxProvider]:
    async with DockerSandboxProvider(pool_size=2, client=docker_client) as provider:
        yield provider


async def test_exec_round_trip(provider: DockerSandboxProvider) -> None:
    async with provider.sandbox(SPEC) as box:
        result = await box.exec(
            [
                "python3",
                "-c",
                "import json, sys, os; print(json.dumps([sys.stdin.read(), os.environ['X']]))",
            ],
            timeout_s=10,
            stdin=b"from stdin",
            env={"X": "from env"},
        )
        assert result.ok, result
        assert result.stdout == '["from stdin", "from env"]\n'
        who = await box.exec(["sh", "-c", "id -u; pwd"], timeout_s=10)
        assert who.stdout.split() == ["65534", "/work"]
        await box.write_file("pkg/data.txt", b"payload", mode=0o666)
        assert await box.read_file("/work/pkg/data.txt") == b"payload"
        edited = await box.exec(
            ["sh", "-c", "echo more >> pkg/data.txt && cat pkg/data.txt"], timeout_s=10
        )
        assert edited.stdout == "payloadmore\n"
        failed = await box.exec(["sh", "-c", "echo oops >&2; exit 3"], timeout_s=10)
        assert (failed.exit_code, failed.stderr, failed.ok) == (3, "oops\n", False)
        with pytest.raises(FileNotFoundError):
            await box.read_file("missing.txt")


async def test_output_is_capped(provider: DockerSandboxProvider) -> None:
    async with provider.sandbox(SPEC) as box:
        result = await box.exec(["python3", "-c", "print('x' * 100_000)"], timeout_s=10)
    assert result.ok and result.truncated
    assert len(result.stdout) == SPEC.output_limit_bytes


async def test_no_network_unless_asked(
    provider: DockerSandboxProvider, docker_client: docker.DockerClient
) -> None:
    probe = [
        "python3",
        "-c",
        "import socket\n"
        "try:\n    socket.create_connection(('1.1.1.1', 53), timeout=2); print('connected')\n"
        "except OSError as e: print('refused', e.errno)\n"
        "print(sorted(l.split(':')[0].strip() for l in open('/proc/net/dev').readlines()[2:]))",
    ]
    async with provider.sandbox(SPEC) as box:
        closed = await box.exec(probe, timeout_s=10)
        mode = docker_client.api.inspect_container(box.container_id)["HostConfig"]["NetworkMode"]
    assert mode == "none"
    assert closed.stdout.splitlines() == ["refused 101", "['lo']"]  # ENETUNREACH, loopback only
    # With network=True the container gets the engine's network (the host's when the engine runs
    # with --bridge=none): more than a loopback interface.
    async with provider.sandbox(SandboxSpec(network=True, memory_mb=128, pids=64)) as box:
        opened = await box.exec(probe, timeout_s=10)
        mode = docker_client.api.inspect_container(box.container_id)["HostConfig"]["NetworkMode"]
    assert mode in {"bridge", "host"}
    assert opened.stdout.splitlines()[-1] != "['lo']"


async def test_root_is_read_only_and_commands_have_no_capabilities(
    provider: DockerSandboxProvider,
) -> None:
    async with provider.sandbox(SPEC) as box:
        result = await box.exec(
            [
                "sh",
                "-c",
                "touch /usr/x || echo usr-denied; touch /etc/x || echo etc-denied; "
                "echo ok > /work/x && echo /tmp > /tmp/x && echo work-ok; "
                "grep CapEff /proc/self/status",
            ],
            timeout_s=10,
        )
    assert result.stdout.splitlines() == [
        "usr-denied",
        "etc-denied",
        "work-ok",
        "CapEff:\t0000000000000000",
    ]
    assert "Read-only file system" in result.stderr


async def test_hidden_file_is_not_readable_by_the_sandbox_user(
    provider: DockerSandboxProvider,
) -> None:
    async with provider.sandbox(SPEC) as box:
        await assert_hidden_file_is_unreadable(box)


async def test_timeout_kills_a_command_that_ignores_sigterm(
    provider: DockerSandboxProvider,
) -> None:
    async with provider.sandbox(SPEC) as box:
        started = time.monotonic()
        result = await box.exec(["sh", "-c", "trap '' TERM; sleep 60"], timeout_s=1)
        assert time.monotonic() - started < 2.0
        assert result.timed_out and not result.ok
        # A descendant that leaves the process group and keeps the output open is killed too.
        started = time.monotonic()
        escaped = await box.exec(
            ["sh", "-c", "setsid sh -c 'trap \"\" TERM; sleep 60' & sleep 60"], timeout_s=1
        )
        assert time.monotonic() - started < 2.5
        assert escaped.timed_out
        left = await box.exec(PS, timeout_s=10)
    assert "sleep 60" not in left.stdout


async def test_memory_bomb_is_killed_and_the_sandbox_survives(
    provider: DockerSandboxProvider,
) -> None:
    async with provider.sandbox(SPEC) as box:
        bomb = await box.exec(
            ["python3", "-c", "chunks = []\nwhile True: chunks.append(bytearray(8 << 20))"],
            timeout_s=30,
        )
        assert bomb.exit_code == 137 and not bomb.timed_out  # the OOM killer, not the clock
        assert (await box.exec(["echo", "alive"], timeout_s=10)).stdout == "alive\n"


@pytest.mark.slow
async def test_fork_bomb_is_contained(provider: DockerSandboxProvider) -> None:
    bomb = "import os\nwhile True:\n    try: os.fork()\n    except OSError: pass"
    async with provider.sandbox(SPEC) as box:
        started = time.monotonic()
        result = await box.exec(["python3", "-c", bomb], timeout_s=3)
        assert result.timed_out and time.monotonic() - started < 4.5
        # The host is fine: it still starts processes at once.
        with anyio.fail_after(5):
            assert (await anyio.run_process(["true"])).returncode == 0
        assert (await box.exec(["echo", "alive"], timeout_s=10)).stdout == "alive\n"


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
        processes = await second.exec(PS, timeout_s=10)
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


async def test_a_missing_image_says_how_to_build_it(docker_client: docker.DockerClient) -> None:
    async with DockerSandboxProvider(client=docker_client, reap_stale=False) as provider:
        with pytest.raises(SandboxError, match="build-image libra/does-not-exist"):
            async with provider.sandbox(SandboxSpec(image="libra/does-not-exist")):
                pass
