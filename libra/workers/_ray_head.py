"""A local Ray head in a process of its own (``ray start --head --block``), for a driver to
attach to.

Why not ``ray.init()``, which starts the head itself: it forks the head's processes from
this one, running Python in the child before ``exec`` (Ray's ``preexec_fn``). A forked
child of a process with many threads (torch's, anyio's, the trainer's pipes) holds
whatever locks those threads held at the fork; in a long test run that child segfaulted
before it could start Ray's GCS, and ``ray.init`` timed out waiting for it. ``ray start``
forks from a fresh, single-threaded interpreter instead."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress

from libra._net import free_port

#: ``ray start`` prints this once the head is up, then blocks.
_STARTED = "Ray runtime started"
#: How long the head may take to stop cleanly before its process group is killed.
_STOP_S = 30.0
_START_S = 120.0
#: ``ray start``, asking Linux first to stop it (SIGTERM, which it handles by stopping the
#: head) when the thread that started it exits; the head's own processes die with it.
_DIE_WITH_PARENT_THEN_RAY = """
import ctypes, os, signal, sys
ctypes.CDLL(None).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
if os.getppid() != int(os.environ["LIBRA_RAY_PARENT"]):
    sys.exit(1)  # the parent died before the request was made
from ray.scripts.scripts import main
main()
"""


@contextmanager
def ray_head(cpus: int) -> Iterator[str]:
    """A Ray head of ``cpus`` CPUs on this machine, yielding its address; stopped (with the
    workers its raylet started) on exit, or when the thread that called this exits."""
    port = free_port()
    command = [
        sys.executable,
        "-c",
        _DIE_WITH_PARENT_THEN_RAY,
        "start",
        "--head",
        "--block",
        f"--port={port}",
        f"--num-cpus={cpus}",
        "--include-dashboard=false",
        "--disable-usage-stats",
    ]
    # A session of its own, so that stopping it reaches every process the head started.
    head = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env={**os.environ, "LIBRA_RAY_PARENT": str(os.getpid())},
    )
    try:
        _wait_started(head, " ".join(command[3:]))
        yield f"127.0.0.1:{port}"
    finally:
        _stop(head)


def _wait_started(head: subprocess.Popen[str], command: str) -> None:
    assert head.stdout is not None
    seen: list[str] = []
    # Reading blocks on the head's output; a head that hangs without a word is bounded by
    # a timer that kills it, which ends the output.
    timer = _kill_after(head, _START_S)
    try:
        for line in head.stdout:
            seen.append(line)
            if _STARTED in line:
                return
    finally:
        timer.cancel()
    head.wait()
    tail = "".join(seen[-30:])
    raise RuntimeError(f"`ray {command}` exited ({head.returncode}) before Ray started:\n{tail}")


def _kill_after(head: subprocess.Popen[str], seconds: float) -> threading.Timer:
    timer = threading.Timer(seconds, _kill_group, args=(head,))
    timer.daemon = True
    timer.start()
    return timer


def _stop(head: subprocess.Popen[str]) -> None:
    """SIGTERM to the head alone: ``ray start --block`` stops the processes it started on
    it (sent to the whole group, it waits for ones that are already gone)."""
    if head.poll() is None:
        head.terminate()
        with suppress(subprocess.TimeoutExpired):
            head.wait(timeout=_STOP_S)
    _kill_group(head)  # whatever outlived the head (a worker it left) goes with its group
    head.wait()
    if head.stdout is not None:
        head.stdout.close()


def _kill_group(head: subprocess.Popen[str]) -> None:
    with suppress(ProcessLookupError):
        os.killpg(head.pid, signal.SIGKILL)
