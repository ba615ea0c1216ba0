"""Running the emulated server on a real port: uvicorn, a command line, a test fixture.

``serve`` runs the app under uvicorn tuned for many concurrent clients (httptools,
uvloop, a deep accept backlog, no access log). ``python -m libra.emulation`` is its
command line. ``running_emulator`` starts a server in a subprocess on a free port for
tests and benchmarks and stops it on exit; the child also exits when its parent dies
(it watches its stdin, which only the parent holds), so no server outlives its user.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import IO

import anyio
import httpx
import uvicorn

from libra._process import wait_exited
from libra.emulation._app import create_app
from libra.emulation._config import EmulatorConfig
from libra.emulation._latency import LatencyModel
from libra.emulation._scripts import AgentScript, Script

# Pending connections the kernel may queue: enough for 10,000 clients connecting at
# once (Linux caps it at net.core.somaxconn).
_BACKLOG = 16384


def serve(
    config: EmulatorConfig | None = None,
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    sock: socket.socket | None = None,
    script: Script | None = None,
) -> None:
    """Serve an emulated vLLM server until SIGINT/SIGTERM; on ``sock`` if given."""
    _raise_open_file_limit()
    app = create_app(config, script)
    app.faults.on_death = _exit_at_once  # an injected death ends the process, as a crash does
    server_config = uvicorn.Config(
        app,
        host=host,
        port=port,
        http="httptools",
        loop="uvloop",
        lifespan="on",
        access_log=False,
        log_level="warning",
        backlog=_BACKLOG,
        timeout_graceful_shutdown=5,
    )
    uvicorn.Server(server_config).run(sockets=None if sock is None else [sock])


def _exit_at_once() -> None:
    """Die without cleanup: open connections are cut, the port closes."""
    os._exit(1)


def _raise_open_file_limit() -> None:
    """Let the process hold as many sockets as the hard limit allows (one per client)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = max(soft, 1 << 20) if hard == resource.RLIM_INFINITY else hard
    # On failure keep the soft limit: the server still runs, with fewer clients.
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


# ----------------------------------------------------------------------- command line


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m libra.emulation",
        description="Serve an emulated vLLM OpenAI-compatible server.",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--latency",
        choices=("zero", "default"),
        default="default",
        help="'zero' answers at once; 'default' emulates a small model on one GPU.",
    )
    parser.add_argument("--script", choices=("agent", "echo"), default="agent")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model-name", default="libra-emulated")
    parser.add_argument("--max-model-len", type=int, default=32768)
    parser.add_argument("--error-rate", type=float, default=0.0, help="Fraction of HTTP 500s.")
    parser.add_argument(
        "--garbage-rate", type=float, default=0.0, help="Fraction of malformed agent replies."
    )
    parser.add_argument(
        "--stall-rate", type=float, default=0.0, help="Fraction of requests never answered."
    )
    parser.add_argument(
        "--abort-rate", type=float, default=0.0, help="Fraction of requests aborted midway."
    )
    parser.add_argument(
        "--http-garbage-rate",
        type=float,
        default=0.0,
        help="Fraction of 200 answers whose body is not an OpenAI response.",
    )
    parser.add_argument("--die-rate", type=float, default=0.0, help="Chance per request to die.")
    parser.add_argument(
        "--die-after", type=int, help="Exit on the generation request after this many."
    )
    parser.add_argument(
        "--think-tokens",
        type=int,
        nargs=2,
        metavar=("LOW", "HIGH"),
        default=(0, 0),
        help="Range of filler tokens before each agent action.",
    )
    parser.add_argument(
        "--config-json",
        help="A whole EmulatorConfig as JSON; replaces every option above but --host/--port.",
    )
    # Used by running_emulator: serve on an inherited listening socket, and exit when
    # stdin closes (the parent died or is done).
    parser.add_argument("--fd", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--exit-with-parent", action="store_true", help=argparse.SUPPRESS)
    return parser


def config_from_args(args: argparse.Namespace) -> EmulatorConfig:
    """The EmulatorConfig the command-line options describe."""
    if args.config_json:
        return EmulatorConfig.model_validate_json(args.config_json)
    return EmulatorConfig(
        model_name=args.model_name,
        latency=LatencyModel.zero() if args.latency == "zero" else LatencyModel(),
        script=args.script,
        agent=AgentScript(garbage_rate=args.garbage_rate, think_tokens=tuple(args.think_tokens)),
        seed=args.seed,
        max_model_len=args.max_model_len,
        error_rate=args.error_rate,
        stall_rate=args.stall_rate,
        abort_rate=args.abort_rate,
        garbage_rate=args.http_garbage_rate,
        die_rate=args.die_rate,
        die_after=args.die_after,
    )


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of ``python -m libra.emulation``."""
    args = build_parser().parse_args(argv)
    config = config_from_args(args)
    if args.exit_with_parent:
        threading.Thread(target=_terminate_when_stdin_closes, daemon=True).start()
    sock = None if args.fd is None else socket.socket(fileno=args.fd)
    serve(config, args.host, args.port, sock=sock)


def _terminate_when_stdin_closes() -> None:
    sys.stdin.buffer.read()  # returns at EOF: the parent closed the pipe or died
    os.kill(os.getpid(), signal.SIGTERM)


# ---------------------------------------------------------------------- subprocess


@contextmanager
def running_emulator(
    config: EmulatorConfig | None = None,
    *,
    host: str = "127.0.0.1",
    startup_timeout_s: float = 30.0,
) -> Iterator[str]:
    """Run an emulated server in a subprocess on a free port; yield its base URL.

    The port is bound here and the socket handed to the child, so no other process can
    take it in between. On exit the server is terminated (killed if it does not stop).
    """
    with emulator_process(config, host=host, startup_timeout_s=startup_timeout_s) as server:
        yield server.url


@dataclass(frozen=True)
class EmulatorProcess:
    """An emulated server running in a subprocess (what a test kills to lose a server)."""

    url: str
    process: subprocess.Popen[bytes]

    def kill(self) -> None:
        """Gone at once, as after a crash: no graceful shutdown, calls in flight cut."""
        self.process.kill()
        self.process.wait()


@contextmanager
def emulator_process(
    config: EmulatorConfig | None = None,
    *,
    host: str = "127.0.0.1",
    startup_timeout_s: float = 30.0,
) -> Iterator[EmulatorProcess]:
    """:func:`running_emulator`, yielding the process too."""
    config = config or EmulatorConfig()
    with tempfile.TemporaryFile() as log:
        process, port = _spawn(config, host, log)
        try:
            url = f"http://{host}:{port}"
            _wait_until_healthy(url, process, log, startup_timeout_s)
            yield EmulatorProcess(url, process)
        finally:
            _stop(process)


class EmulatorServer:
    """An emulated server in a subprocess that stops, dies, hangs and starts again on the
    same address: the restartable kind of server a supervisor manages (as it manages a
    vLLM server), for tests that need a real process without vLLM's start-up time."""

    def __init__(
        self,
        config: EmulatorConfig | None = None,
        *,
        host: str = "127.0.0.1",
        startup_timeout_s: float = 30.0,
        stop_grace_s: float = 2.0,
    ) -> None:
        self.config = config or EmulatorConfig()
        self.host, self.startup_timeout_s, self.stop_grace_s = host, startup_timeout_s, stop_grace_s
        self.starts = 0
        self._port = 0
        self._process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self._port}"

    @property
    def is_running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    async def astart(self) -> None:
        if self.is_running:
            raise RuntimeError(f"the emulated server at {self.url} is already running")
        self._release()
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 (lives as long as the process)
        self._process, self._port = _spawn(self.config, self.host, self._log, port=self._port)
        self.starts += 1
        wait = partial(_wait_until_healthy, self.url, self._process, self._log)
        await anyio.to_thread.run_sync(wait, self.startup_timeout_s)

    async def astop(self) -> None:
        process = self._process
        if process is not None:
            await anyio.to_thread.run_sync(partial(_stop, process, self.stop_grace_s))
        self._release()

    async def wait_exited(self) -> None:
        if self._process is not None:
            await wait_exited(self._process.pid)

    def kill(self) -> None:
        """Gone at once, as after a crash: calls in flight cut."""
        if self._process is not None:
            self._process.kill()
            self._process.wait()

    def hang(self) -> None:
        """Alive but answering nothing (SIGSTOP), as a wedged server is."""
        if self._process is not None:
            self._process.send_signal(signal.SIGSTOP)

    def _release(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None
        self._process = None


def _spawn(
    config: EmulatorConfig, host: str, log: IO[bytes], *, port: int = 0
) -> tuple[subprocess.Popen[bytes], int]:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        port = listener.getsockname()[1]
        command = [
            sys.executable,
            "-m",
            "libra.emulation",
            "--fd",
            str(listener.fileno()),
            "--exit-with-parent",
            "--config-json",
            config.model_dump_json(),
        ]
        process = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=log,
            stderr=subprocess.STDOUT,
            pass_fds=(listener.fileno(),),
            env=_child_environment(),
        )
    return process, port


def _child_environment() -> dict[str, str]:
    """This environment, with this checkout of ``libra`` importable in the child."""
    env = dict(os.environ)
    source_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (source_root, env.get("PYTHONPATH"))))
    return env


def _wait_until_healthy(
    url: str, process: subprocess.Popen[bytes], log: IO[bytes], timeout_s: float
) -> None:
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=1.0) as client:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(
                    f"emulated server exited with {process.returncode}:\n{_read_log(log)}"
                )
            try:
                if client.get(f"{url}/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass  # not listening yet
            time.sleep(0.05)
    raise TimeoutError(f"emulated server not healthy after {timeout_s} s:\n{_read_log(log)}")


def _read_log(log: IO[bytes]) -> str:
    log.seek(0)
    return log.read().decode(errors="replace")[-4000:]


def _stop(process: subprocess.Popen[bytes], grace_s: float = 10.0) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    if process.stdin is not None:
        process.stdin.close()
