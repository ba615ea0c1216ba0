"""``docker exec`` over a hijacked socket: how the Docker sandboxes run commands.

A sandbox's exec must feed stdin, keep at most ``output_limit`` bytes of each stream and stop
waiting at a deadline, even when the command never reads its stdin or never ends. The Docker
SDK's ``exec_start`` has no per-call deadline, and with ``socket=True`` hands back the bare socket,
losing any output already buffered while the HTTP headers were read. So, as ``docker exec``
itself does, the exec is started with an ``Upgrade: tcp`` request whose response object is
kept: its buffered reader yields Docker's framed stdout/stderr stream, read under socket
timeouts until the stream ends or the deadline passes, while a thread writes stdin. This
reaches into private parts of the SDK and of urllib3 (``api._post_json``, ``response.raw._fp``),
which is one more reason to keep it apart. Everything here blocks: run it in a worker thread.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any

from libra.envs import SandboxError
from libra.sandbox._common import CappedOutput

if TYPE_CHECKING:
    import docker

__all__ = ["RawExec", "exec_blocking"]


@dataclass(frozen=True, slots=True)
class RawExec:
    """What an exec left; ``exit_code`` is None when the deadline came first (``deadline_hit``)
    or the engine did not report it in time."""

    exit_code: int | None
    stdout: bytes
    stderr: bytes
    truncated: bool
    deadline_hit: bool


def exec_blocking(
    api: docker.APIClient,
    container_id: str,
    cmd: Sequence[str],
    *,
    user: str,
    workdir: str,
    env: Mapping[str, str],
    stdin: bytes | None,
    output_limit: int,
    deadline: float,
) -> RawExec:
    """Run ``cmd`` in the container and collect its output until it ends or ``deadline``."""
    exec_id = api.exec_create(
        container_id,
        list(cmd),
        stdin=stdin is not None,
        stdout=True,
        stderr=True,
        user=user,
        workdir=workdir,
        environment=[f"{key}={value}" for key, value in env.items()],
    )["Id"]
    response = _start_exec_hijacked(api, exec_id)
    output = CappedOutput(output_limit)
    try:
        reader, sock = _hijacked_streams(response)
        if stdin is not None:
            _feed_stdin_in_background(sock, stdin)
        finished = _read_frames(reader, sock, output, deadline)
    finally:
        response.close()
    exit_code = _wait_exit_code(api, exec_id, deadline + 1.0) if finished else None
    return RawExec(
        exit_code, bytes(output.stdout), bytes(output.stderr), output.truncated, not finished
    )


def _start_exec_hijacked(api: docker.APIClient, exec_id: str) -> Any:
    """``POST /exec/{id}/start`` upgraded to a raw stream, as ``docker exec`` does.

    The SDK's ``exec_start(socket=True)`` hands back the bare socket, losing any output already
    buffered while the HTTP headers were read; here the response object is kept and read
    through its buffered reader.
    """
    response = api._post_json(
        api._url("/exec/{0}/start", exec_id),
        headers={"Connection": "Upgrade", "Upgrade": "tcp"},
        data={"Tty": False, "Detach": False},
        stream=True,
    )
    api._raise_for_status(response)
    return response


def _hijacked_streams(response: Any) -> tuple[IO[bytes], socket.socket]:
    reader: IO[bytes] = response.raw._fp.fp
    raw = reader.raw  # type: ignore[attr-defined]
    sock = getattr(raw, "_sock", raw)
    if not isinstance(sock, socket.socket):
        raise SandboxError(f"unsupported Docker transport for exec streams: {type(sock)!r}")
    return reader, sock


def _feed_stdin_in_background(sock: socket.socket, data: bytes) -> None:
    """Send stdin then half-close; a thread, so a command that never reads it cannot block us."""

    def feed() -> None:
        with contextlib.suppress(OSError):
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)

    threading.Thread(target=feed, name="libra-sandbox-stdin", daemon=True).start()


def _read_frames(
    reader: IO[bytes], sock: socket.socket, output: CappedOutput, deadline: float
) -> bool:
    """Demultiplex Docker's framed stream; True at end of stream, False at the deadline."""
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        sock.settimeout(remaining)
        try:
            header = reader.read(8)
            if len(header) < 8:
                return True
            stream, length = struct.unpack(">BxxxL", header)
            payload = reader.read(length)
        except (TimeoutError, OSError):
            return False
        output.add(stream, payload)
        if len(payload) < length:
            return True


def _wait_exit_code(api: docker.APIClient, exec_id: str, deadline: float) -> int | None:
    """The exec's exit code; the engine may report it a moment after the stream closes."""
    while True:
        state = api.exec_inspect(exec_id)
        if not state.get("Running") and state.get("ExitCode") is not None:
            return int(state["ExitCode"])
        if time.monotonic() > deadline:
            return None
        time.sleep(0.01)
