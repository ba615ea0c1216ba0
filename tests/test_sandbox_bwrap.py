"""Bubblewrap sandboxes: same protocol and limits as Docker's, no Docker needed.

Skipped when ``bwrap`` is missing (apt-get install bubblewrap), except the test that the
provider then refuses to run. The image root filesystem is used when it can be built (root and
debootstrap), otherwise the host's system dirs.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest

from libra.envs import SandboxError, SandboxSpec
from libra.sandbox import BwrapSandboxProvider, build_rootfs, reap_stale_workdirs
from libra.sandbox._bwrap import _workdirs_parent
from tests._helpers import assert_hidden_file_is_unreadable, unavailable

pytestmark = pytest.mark.anyio

SPEC = SandboxSpec(memory_mb=256, pids=32, workdir_size_mb=16, output_limit_bytes=4096)
AS_ROOT = os.geteuid() == 0
needs_bwrap = pytest.mark.skipif(
    shutil.which("bwrap") is None, reason="bubblewrap is not installed (apt-get install bubblewrap)"
)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def root() -> Path | str:
    """The image's root filesystem when it can be built here, else the host's dirs."""
    if shutil.which("bwrap") is None:
        unavailable("bubblewrap is not installed (apt-get install bubblewrap)")
    if AS_ROOT and shutil.which("debootstrap"):
        return build_rootfs("libra/python")  # idempotent: instant when already built
    return "host"


@pytest.fixture
async def provider(root: Path | str) -> AsyncIterator[BwrapSandboxProvider]:
    async with BwrapSandboxProvider(root=root if isinstance(root, Path) else "host") as provider:
        yield provider


async def test_refuses_to_run_without_bwrap(monkeypatch: pytest.MonkeyPatch) -> None:
    real_which = shutil.which
    monkeypatch.setattr(shutil, "which", lambda name: None if name == "bwrap" else real_which(name))
    with pytest.raises(SandboxError, match="apt-get install -y bubblewrap"):
        async with BwrapSandboxProvider() as provider, provider.sandbox(SPEC):
            pass


@needs_bwrap
@pytest.mark.parametrize("root_kind", ["image", "host"])
async def test_exec_round_trip(root: Path | str, root_kind: str) -> None:
    if root_kind == "image" and not isinstance(root, Path):
        unavailable("the image root filesystem needs root and debootstrap to build")
    chosen = root if root_kind == "image" else "host"
    async with BwrapSandboxProvider(root=chosen) as provider, provider.sandbox(SPEC) as box:
        assert box.rootfs is not None if root_kind == "image" else box.rootfs is None
        result = await box.exec(
            [
                "python3",
                "-c",
                "import json, os, sys; print(json.dumps([sys.stdin.read(), os.environ['X']]))",
            ],
            timeout_s=10,
            stdin=b"from stdin",
            env={"X": "from env"},
        )
        assert result.ok, result
        assert result.stdout == '["from stdin", "from env"]\n'
        who = await box.exec(["sh", "-c", "id -u; pwd; hostname"], timeout_s=10)
        assert who.stdout.split() == ["65534", "/work", "sandbox"]
        await box.write_file("pkg/data.txt", b"payload", mode=0o666)
        edited = await box.exec(
            ["sh", "-c", "echo more >> pkg/data.txt; echo new > pkg/new.txt"], timeout_s=10
        )
        assert edited.ok, edited
        assert await box.read_file("/work/pkg/data.txt") == b"payloadmore\n"
        assert await box.read_file("pkg/new.txt") == b"new\n"
        with pytest.raises(FileNotFoundError):
            await box.read_file("missing.txt")


def test_works_on_trio_too(root: Path | str) -> None:
    async def round_trip() -> str:
        async with BwrapSandboxProvider(root="host") as provider, provider.sandbox(SPEC) as box:
            return (await box.exec(["echo", "trio"], timeout_s=10)).stdout

    assert anyio.run(round_trip, backend="trio") == "trio\n"


async def test_output_is_capped(provider: BwrapSandboxProvider) -> None:
    async with provider.sandbox(SPEC) as box:
        result = await box.exec(["python3", "-c", "print('x' * 100_000)"], timeout_s=10)
    assert result.ok and result.truncated
    assert len(result.stdout) == SPEC.output_limit_bytes


async def test_no_network_unless_asked(provider: BwrapSandboxProvider) -> None:
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
    async with provider.sandbox(SandboxSpec(network=True)) as box:
        opened = await box.exec(probe, timeout_s=10)
    assert opened.stdout.splitlines()[-1] != "['lo']"  # the host's interfaces


async def test_root_is_read_only_and_only_system_dirs_are_visible(
    provider: BwrapSandboxProvider,
) -> None:
    async with provider.sandbox(SPEC) as box:
        result = await box.exec(
            [
                "sh",
                "-c",
                "touch /usr/x || echo usr-denied; touch /etc/x || echo etc-denied; "
                "echo ok > /work/x && echo t > /tmp/x && echo work-ok; ls /",
            ],
            timeout_s=10,
        )
    lines = result.stdout.splitlines()
    assert lines[:3] == ["usr-denied", "etc-denied", "work-ok"]
    system = {"bin", "sbin", "lib", "lib32", "lib64", "libx32", "usr", "etc"}
    assert set(lines[3:]) <= system | {"dev", "proc", "tmp", "work"}  # no /root, /home, /var


@pytest.mark.skipif(not AS_ROOT, reason="a non-root host runs commands under the env's own uid")
async def test_hidden_file_is_not_readable_by_the_sandbox_user(
    provider: BwrapSandboxProvider,
) -> None:
    async with provider.sandbox(SPEC) as box:
        await assert_hidden_file_is_unreadable(box)


async def test_file_access_does_not_follow_the_sandbox_symlinks(
    provider: BwrapSandboxProvider,
) -> None:
    async with provider.sandbox(SPEC) as box:
        await box.exec(
            ["sh", "-c", "ln -s /etc/passwd link; ln -s /etc dir; mkfifo fifo"], timeout_s=10
        )
        with pytest.raises(SandboxError):
            await box.read_file("link")
        with pytest.raises(SandboxError):
            await box.write_file("dir/evil", b"x")
        with pytest.raises(SandboxError):
            await box.read_file("fifo")
        with pytest.raises(SandboxError, match="only under"):
            await box.read_file("/etc/passwd")


async def test_timeout_kills_the_whole_tree(provider: BwrapSandboxProvider) -> None:
    async with provider.sandbox(SPEC) as box:
        started = time.monotonic()
        result = await box.exec(["sh", "-c", "trap '' TERM; sleep 60"], timeout_s=1)
        assert result.timed_out and time.monotonic() - started < 2.0
        started = time.monotonic()
        escaped = await box.exec(
            ["sh", "-c", "setsid sh -c 'trap \"\" TERM; sleep 60' & sleep 60"], timeout_s=1
        )
        assert escaped.timed_out and time.monotonic() - started < 2.0
        # Nothing of the sandbox user is left on the host (every exec has its own pid namespace).
        assert box.host_uid is None or not _processes_of(box.host_uid)


async def test_cancelling_an_exec_kills_it(provider: BwrapSandboxProvider) -> None:
    async with provider.sandbox(SPEC) as box:
        with anyio.move_on_after(0.5):
            await box.exec(["sleep", "60"], timeout_s=60)
        await anyio.sleep(0.2)
        assert box.host_uid is None or not _processes_of(box.host_uid)


async def test_memory_bomb_fails_and_the_sandbox_survives(provider: BwrapSandboxProvider) -> None:
    async with provider.sandbox(SPEC) as box:
        bomb = await box.exec(
            ["python3", "-c", "chunks = []\nwhile True: chunks.append(bytearray(8 << 20))"],
            timeout_s=30,
        )
        assert not bomb.ok and not bomb.timed_out
        assert bomb.exit_code == 137 or "MemoryError" in bomb.stderr
        assert (await box.exec(["echo", "alive"], timeout_s=10)).stdout == "alive\n"


@pytest.mark.slow
async def test_fork_bomb_is_contained_and_other_sandboxes_keep_working(
    provider: BwrapSandboxProvider,
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
        assert (await box.exec(["echo", "alive"], timeout_s=10)).stdout == "alive\n"
    if AS_ROOT:  # only then has each trajectory a process budget of its own
        assert neighbour_results == ["fine\n"]
    with anyio.fail_after(5):
        assert (await anyio.run_process(["true"])).returncode == 0


async def test_directories_are_removed_and_stale_ones_reaped(
    provider: BwrapSandboxProvider,
) -> None:
    async with provider.sandbox(SPEC) as box:
        await box.write_file("a.txt", b"a")
        base = box._scratch.base
        assert base.is_dir()
    assert not base.exists()
    assert str(base) not in await anyio.Path("/proc/self/mounts").read_text()
    async with await anyio.open_process(["true"]) as dead:
        await dead.wait()
    stale = _workdirs_parent() / f"{dead.pid}-1-deadbeef"
    (stale / "work").mkdir(parents=True)
    assert stale in reap_stale_workdirs()
    assert not stale.exists()


def _processes_of(uid: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == uid:
                    pids.append(int(entry.name))
            except FileNotFoundError:
                continue
    return pids
