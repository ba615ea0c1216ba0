"""What every SandboxProvider must do, checked on each real backend: Docker and bubblewrap.

Each test runs once per provider (``[docker]``, ``[bwrap]``); a missing Docker engine or
``bwrap`` skips that backend's runs locally and fails them in CI. What only one backend does
(Docker's warm pool and reaper, bwrap's root kinds and directories) is tested in
test_sandbox_docker.py and test_sandbox_bwrap.py. Where backends meet a limit differently, a
test says what each one shows.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import AsyncIterator

import anyio
import pytest

from libra.envs import SandboxProvider, SandboxSpec
from libra.sandbox import BwrapSandbox, BwrapSandboxProvider, DockerSandboxProvider
from tests._helpers import (
    LIST_PROCESSES,
    assert_exec_round_trip,
    assert_hidden_file_is_unreadable,
    processes_of,
)

pytestmark = pytest.mark.anyio

SPEC = SandboxSpec(memory_mb=256, pids=64, workdir_size_mb=16, output_limit_bytes=4096)
AS_ROOT = os.geteuid() == 0
BACKENDS = [
    pytest.param("docker", marks=pytest.mark.docker),
    pytest.param("bwrap", marks=pytest.mark.bwrap),
]


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    # Docker's SDK runs in worker threads either way; one backend keeps one module-wide loop
    # (bwrap on trio: test_sandbox_bwrap.py).
    return "asyncio"


@pytest.fixture(scope="module", params=BACKENDS)
async def provider(request: pytest.FixtureRequest) -> AsyncIterator[SandboxProvider]:
    """One provider per backend for the module: Docker's containers (~1-3 s each to start on
    the vfs storage driver) are reused across tests exactly as across trajectories."""
    if request.param == "docker":
        client = request.getfixturevalue("docker_client")
        async with DockerSandboxProvider(pool_size=2, client=client) as docker_provider:
            yield docker_provider
    else:
        root = request.getfixturevalue("bwrap_root")
        async with BwrapSandboxProvider(root=root) as bwrap_provider:
            yield bwrap_provider


async def test_exec_round_trip(provider: SandboxProvider) -> None:
    async with provider.sandbox(SPEC) as box:
        await assert_exec_round_trip(box)


async def test_exec_refuses_no_command_or_no_time(provider: SandboxProvider) -> None:
    async with provider.sandbox(SPEC) as box:
        with pytest.raises(ValueError, match="argv must name a command"):
            await box.exec([], timeout_s=10)
        with pytest.raises(ValueError, match="timeout_s must be positive"):
            await box.exec(["true"], timeout_s=0)


async def test_output_is_capped(provider: SandboxProvider) -> None:
    async with provider.sandbox(SPEC) as box:
        result = await box.exec(["python3", "-c", "print('x' * 100_000)"], timeout_s=10)
    assert result.ok and result.truncated
    assert len(result.stdout) == SPEC.output_limit_bytes


async def test_no_network_unless_asked(provider: SandboxProvider) -> None:
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
    assert closed.stdout.splitlines() == ["refused 101", "['lo']"]  # ENETUNREACH, loopback only
    # With network=True: Docker's network (the host's when the engine runs with
    # --bridge=none), the host's for bwrap; either way more than a loopback interface.
    async with provider.sandbox(dataclasses.replace(SPEC, network=True)) as box:
        opened = await box.exec(probe, timeout_s=10)
    assert opened.stdout.splitlines()[-1] != "['lo']"


async def test_root_is_read_only_and_commands_have_no_capabilities(
    provider: SandboxProvider,
) -> None:
    async with provider.sandbox(SPEC) as box:
        result = await box.exec(
            [
                "sh",
                "-c",
                "touch /usr/x || echo usr-denied; touch /etc/x || echo etc-denied; "
                "echo ok > /work/x && echo t > /tmp/x && echo work-ok; "
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
    provider: SandboxProvider,
) -> None:
    if isinstance(provider, BwrapSandboxProvider) and not AS_ROOT:
        pytest.skip("a non-root host runs bwrap commands under the env's own uid")
    async with provider.sandbox(SPEC) as box:
        await assert_hidden_file_is_unreadable(box)


async def test_timeout_kills_the_whole_tree(provider: SandboxProvider) -> None:
    async with provider.sandbox(SPEC) as box:
        started = time.monotonic()
        result = await box.exec(["sh", "-c", "trap '' TERM; sleep 60"], timeout_s=1)
        assert time.monotonic() - started < 2.0
        assert result.timed_out and not result.ok
        # A descendant that leaves the process group and keeps the output open is killed too
        # (Docker kills it from the host, after a 0.5 s grace for the output to drain).
        started = time.monotonic()
        escaped = await box.exec(
            ["sh", "-c", "setsid sh -c 'trap \"\" TERM; sleep 60' & sleep 60"], timeout_s=1
        )
        limit_s = 2.5 if isinstance(provider, DockerSandboxProvider) else 2.0
        assert time.monotonic() - started < limit_s
        assert escaped.timed_out
        # bwrap gives every exec its own pid namespace: look for leftovers from the host too
        # (before the next exec, whose finished namespace init may linger as a zombie).
        if isinstance(box, BwrapSandbox) and box.host_uid is not None:
            assert not processes_of(box.host_uid)
        left = await box.exec(LIST_PROCESSES, timeout_s=10)
        assert "sleep 60" not in left.stdout


async def test_memory_bomb_fails_and_the_sandbox_survives(provider: SandboxProvider) -> None:
    async with provider.sandbox(SPEC) as box:
        bomb = await box.exec(
            ["python3", "-c", "chunks = []\nwhile True: chunks.append(bytearray(8 << 20))"],
            timeout_s=30,
        )
        assert not bomb.ok and not bomb.timed_out  # the limit, not the clock
        if isinstance(provider, DockerSandboxProvider):
            assert bomb.exit_code == 137  # the container's OOM killer
        else:  # RLIMIT_AS: an allocation fails first, or the kernel kills
            assert bomb.exit_code == 137 or "MemoryError" in bomb.stderr
        assert (await box.exec(["echo", "alive"], timeout_s=10)).stdout == "alive\n"


@pytest.mark.slow
async def test_fork_bomb_is_contained_and_other_sandboxes_keep_working(
    provider: SandboxProvider,
) -> None:
    bomb = "import os\nwhile True:\n    try: os.fork()\n    except OSError: pass"
    neighbour_results: list[str] = []

    async def neighbour() -> None:
        async with provider.sandbox(SPEC) as other:
            await anyio.sleep(1)  # while the bomb goes off
            neighbour_results.append((await other.exec(["echo", "fine"], timeout_s=10)).stdout)

    async with provider.sandbox(SPEC) as box, anyio.create_task_group() as group:
        group.start_soon(neighbour)
        started = time.monotonic()
        result = await box.exec(["python3", "-c", bomb], timeout_s=3)
        assert result.timed_out and time.monotonic() - started < 4.5
        # The host is fine: it still starts processes at once.
        with anyio.fail_after(5):
            assert (await anyio.run_process(["true"])).returncode == 0
        assert (await box.exec(["echo", "alive"], timeout_s=10)).stdout == "alive\n"
    # Without root, bwrap's trajectories share the env's uid and with it one process budget.
    if isinstance(provider, DockerSandboxProvider) or AS_ROOT:
        assert neighbour_results == ["fine\n"]
