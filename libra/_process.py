"""Waiting for a process to exit without a thread or a poll: a pidfd becomes readable then."""

from __future__ import annotations

import os
import select

import anyio


async def wait_exited(pid: int) -> None:
    """Return once process ``pid`` has exited (at once if it is already gone). Linux's
    ``pidfd_open`` makes this an event-loop wait on any process, child or not."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        await anyio.wait_readable(fd)
    finally:
        os.close(fd)


def exited_within(pid: int, timeout_s: float) -> bool:
    """Whether process ``pid`` has exited, or exits within ``timeout_s`` (a blocking wait:
    from a thread, or where the wait is known to be short, as after a SIGKILL)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        readable, _, _ = select.select([fd], [], [], timeout_s)
        return bool(readable)
    finally:
        os.close(fd)
