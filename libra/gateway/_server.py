"""The gateway's app served over HTTP by uvicorn, inside an anyio event loop already
running: ``libra serve``'s listening socket, and the loopback one an agent's episodes
call (``libra.agents``)."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import AsyncIterator, Callable, Iterator

import anyio
import uvicorn

from libra.gateway._http_protocol import ServeHttpToolsProtocol


class GatewayServer(uvicorn.Server):
    """uvicorn, without its own signal handling: its owner stops it (and then ends its
    sessions) rather than have uvicorn re-raise SIGINT or SIGTERM at the end."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.listening = anyio.Event()

    @property
    def port(self) -> int:
        """The port it listens on (the one picked, when it was given 0)."""
        return int(self.servers[0].sockets[0].getsockname()[1])

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        self.listening.set()


def uvicorn_config(app: Callable[..., object], host: str, port: int) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        http=ServeHttpToolsProtocol,  # httptools, one socket write an answer
        loop="none",  # anyio's loop (uvloop) is already running
        lifespan="off",
        log_level="warning",
        access_log=False,  # a log of requests would hold their headers' neighbours
        backlog=4096,
        proxy_headers=False,  # the gateway reads no client address: no per-request middleware
        server_header=False,  # no banner naming the server (and one header less an answer)
        timeout_keep_alive=60,
    )


@contextlib.asynccontextmanager
async def serving(
    app: Callable[..., object], host: str = "127.0.0.1", port: int = 0
) -> AsyncIterator[str]:
    """Serve ``app`` on ``host:port`` (0: a free port) while the block runs; its base URL."""
    server = GatewayServer(uvicorn_config(app, host, port))
    async with anyio.create_task_group() as group:
        group.start_soon(server.serve)
        await server.listening.wait()
        if not server.started:
            raise OSError(f"the gateway could not listen on {host}:{port} (uvicorn said why)")
        try:
            yield f"http://{host}:{server.port}"
        finally:
            server.should_exit = True
