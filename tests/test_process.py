"""Waiting on a process's exit through its pidfd, on every backend and blocking."""

from __future__ import annotations

import subprocess
import sys

import anyio
import pytest

from libra._process import exited_within, wait_exited

pytestmark = pytest.mark.anyio


async def test_returns_when_the_process_exits_and_not_before() -> None:
    reader = [sys.executable, "-c", "import sys; sys.stdin.read()"]
    async with await anyio.open_process(reader) as child:
        with anyio.move_on_after(0.3) as early:
            await wait_exited(child.pid)
        assert early.cancelled_caught  # still running: no return yet
        assert child.stdin is not None
        await child.stdin.aclose()  # it reads EOF and exits
        with anyio.fail_after(10):
            await wait_exited(child.pid)
        assert await child.wait() == 0


async def test_a_process_already_gone_returns_at_once() -> None:
    async with await anyio.open_process([sys.executable, "-c", "pass"]) as child:
        await child.wait()  # reaped: its pid names nothing now
    with anyio.fail_after(1):
        await wait_exited(child.pid)


def test_exited_within_waits_for_a_killed_process_and_times_out_on_a_live_one() -> None:
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) as child:
        assert not exited_within(child.pid, 0.2)
        child.kill()
        assert exited_within(child.pid, 10)  # exited (a zombie until reaped): that counts
        child.wait()
    assert exited_within(child.pid, 0)  # reaped: gone
