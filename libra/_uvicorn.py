"""uvicorn inside an anyio event loop already running (a run's own): the gateway's
listening socket and the live view's alike."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import AsyncIterator, Iterator

import anyio
import uvicorn

from libra.config import UsageError


class ListeningServer(uvicorn.Server):
    """uvicorn without its own signal handling: its owner stops it (and then ends what it
    serves) rather than have uvicorn re-raise SIGINT or SIGTERM at the end. ``listening``
    is set once it has tried to bind (``started`` says whether it did)."""

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
        try:
            await super().startup(sockets)
        except SystemExit:  # it could not bind, and logged why: ``started`` stays False
            self.should_exit = True
        finally:
            self.listening.set()


@contextlib.asynccontextmanager
async def running(server: ListeningServer, what: str) -> AsyncIterator[int]:
    """Run ``server`` while the block runs; the port it listens on. ``what`` names it in
    the error when it cannot listen."""
    async with anyio.create_task_group() as group:
        group.start_soon(server.serve)
        await server.listening.wait()
        if server.started:
            try:
                yield server.port
            finally:
                server.should_exit = True
    if not server.started:  # (its task ended: nothing to stop)
        config = server.config
        raise UsageError(
            f"{what} could not listen on {config.host}:{config.port}: the port is taken, "
            "or the address is not this machine's (the line above says which)"
        )
