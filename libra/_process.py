"""Waiting for a process to exit without a thread or a poll: a pidfd becomes readable then."""

from __future__ import annotations

import os

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
