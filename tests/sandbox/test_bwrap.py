"""Bubblewrap sandboxes: what only bwrap does, or does its own way.

What every provider must do (limits, timeouts, network...) is in test_sandbox_contract.py.
Skipped when ``bwrap`` is missing (apt-get install bubblewrap), except the test that the
provider then refuses to run. The image root filesystem is used when it can be built (root and
debootstrap), otherwise the host's system dirs.
"""

from __future__ import annotations

import functools
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Literal

import anyio
import pytest

from libra.envs import SandboxError, SandboxSpec
from libra.sandbox import BwrapSandboxProvider, reap_stale_workdirs
from libra.sandbox._bwrap_scratch import workdirs_parent
from libra.sandbox._cgroups import create_cgroup
from tests._helpers import assert_exec_round_trip, processes_of, unavailable

pytestmark = pytest.mark.anyio

SPEC = SandboxSpec(memory_mb=256, pids=32, workdir_size_mb=16, output_limit_bytes=4096)


@pytest.fixture
async def provider(
    bwrap_root: Path | Literal["host"],
) -> AsyncIterator[BwrapSandboxProvider]:
    async with BwrapSandboxProvider(root=bwrap_root) as provider:
        yield provider


async def test_refuses_to_run_without_bwrap(monkeypatch: pytest.MonkeyPatch) -> None:
    real_which = shutil.which
    monkeypatch.setattr(shutil, "which", lambda name: None if name == "bwrap" else real_which(name))
    with pytest.raises(SandboxError, match="apt-get install -y bubblewrap"):
        async with BwrapSandboxProvider() as provider, provider.sandbox(SPEC):
            pass


@pytest.mark.parametrize("root_kind", ["image", "host"])
async def test_exec_round_trip_on_each_root(
    bwrap_root: Path | Literal["host"], root_kind: str
) -> None:
    if root_kind == "image" and not isinstance(bwrap_root, Path):
        unavailable("the image root filesystem needs root and debootstrap to build")
    chosen = bwrap_root if root_kind == "image" else "host"
    async with BwrapSandboxProvider(root=chosen) as provider, provider.sandbox(SPEC) as box:
        assert box.rootfs is not None if root_kind == "image" else box.rootfs is None
        await assert_exec_round_trip(box)
        # Only the work dir and /tmp take writes, whichever root the system dirs come from.
        refused = await box.exec(["sh", "-c", "touch /etc/x; touch /x"], timeout_s=10)
        assert refused.stderr.count("Read-only file system") == 2


@pytest.mark.usefixtures("bwrap_root")  # for its check that bwrap is installed
def test_works_on_trio_too() -> None:
    async def round_trip() -> str:
        async with BwrapSandboxProvider(root="host") as provider, provider.sandbox(SPEC) as box:
            return (await box.exec(["echo", "trio"], timeout_s=10)).stdout

    assert anyio.run(round_trip, backend="trio") == "trio\n"


async def test_only_system_dirs_are_visible(provider: BwrapSandboxProvider) -> None:
    async with provider.sandbox(SPEC) as box:
        result = await box.exec(["ls", "/"], timeout_s=10)
    system = {"bin", "sbin", "lib", "lib32", "lib64", "libx32", "usr", "etc"}
    assert set(result.stdout.split()) <= system | {"dev", "proc", "tmp", "work"}  # no /root, /home


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


async def test_cancelling_an_exec_kills_it(provider: BwrapSandboxProvider) -> None:
    async with provider.sandbox(SPEC) as box:
        with anyio.move_on_after(0.5):
            await box.exec(["sleep", "60"], timeout_s=60)
        await anyio.sleep(0.2)
        assert box.host_uid is None or not processes_of(box.host_uid)


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
    stale = workdirs_parent() / f"{dead.pid}-1-deadbeef"
    (stale / "work").mkdir(parents=True)
    assert stale in reap_stale_workdirs()
    assert not stale.exists()


async def test_many_quick_calls_keep_their_whole_process_budget(
    provider: BwrapSandboxProvider,
) -> None:
    # Each call leaves bwrap's namespace init for the host's init to reap, which can take
    # seconds; the process limit must not count those leftovers against the next call.
    spec = SandboxSpec(memory_mb=256, pids=6, workdir_size_mb=16)
    async with provider.sandbox(spec) as box:
        for _ in range(20):
            result = await box.exec(["sh", "-c", "true & true & true & wait"], timeout_s=10)
            assert result.exit_code == 0, result.stderr


async def test_each_sandbox_has_a_cgroup_that_goes_with_it(
    provider: BwrapSandboxProvider,
) -> None:
    async with provider.sandbox(SPEC) as box:
        cgroup = box._scratch.cgroup
        if cgroup is None:
            pytest.skip("no cgroup can be made here (not root, or no writable cgroup fs)")
        limits = {
            path.name: path.read_text().strip()
            for directory in cgroup.dirs
            for path in directory.iterdir()
            if path.name in {"memory.limit_in_bytes", "memory.max", "cpu.cfs_quota_us", "cpu.max"}
        }
        async with anyio.create_task_group() as group:
            group.start_soon(functools.partial(box.exec, ["sleep", "1"], timeout_s=10))
            await anyio.sleep(0.5)
            members = cgroup.pids()  # the running command is in it
    memory = str(SPEC.memory_mb << 20)
    assert limits.get("memory.limit_in_bytes", memory) == limits.get("memory.max", memory)
    assert memory in limits.values()
    quota = str(round(SPEC.cpus * 100_000))  # per 100 ms period
    assert quota in (limits.get("cpu.cfs_quota_us"), limits.get("cpu.max", "").split(" ")[0])
    assert members
    assert not any(directory.exists() for directory in cgroup.dirs)


async def test_cgroups_of_dead_runs_are_reaped(provider: BwrapSandboxProvider) -> None:
    async with await anyio.open_process(["true"]) as dead:
        await dead.wait()
    stale = create_cgroup(f"{dead.pid}-1-deadbeef", memory_mb=64, cpus=1.0, pids=8)
    if stale is None:
        pytest.skip("no cgroup can be made here (not root, or no writable cgroup fs)")
    reap_stale_workdirs()
    assert not any(directory.exists() for directory in stale.dirs)
