"""The gateway's app served over HTTP by uvicorn, inside an anyio event loop already
running: ``libra serve``'s listening socket, and the loopback one an agent's episodes
call (``libra.agents``)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable

import uvicorn

from libra._uvicorn import ListeningServer, running
from libra.gateway._http_protocol import ServeHttpToolsProtocol


class GatewayServer(ListeningServer):
    """``libra serve``'s uvicorn (its owner stops it, then ends its sessions)."""


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
    async with running(server, "the gateway") as bound:
        yield f"http://{host}:{bound}"
