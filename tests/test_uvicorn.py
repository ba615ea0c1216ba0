"""uvicorn in a running event loop: a server that cannot bind says so in one line, and
the block around it never starts (nor hangs)."""

from __future__ import annotations

import socket

import anyio
import pytest
import uvicorn

from libra._uvicorn import ListeningServer, running
from libra.cli import main
from libra.config import UsageError

pytestmark = pytest.mark.anyio


async def app(scope: object, receive: object, send: object) -> None:
    raise AssertionError("never called")


async def test_a_taken_port_is_one_clear_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="off", loop="none")
        with (
            anyio.fail_after(10),
            pytest.raises(
                UsageError,
                match=f"the gateway could not listen on 127.0.0.1:{port}: the port is taken",
            ),
        ):
            async with running(ListeningServer(config), "the gateway"):
                pytest.fail("the block ran")


def test_libra_serve_on_a_taken_port_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--no-auth", "--port", str(port), "--no-console"]) == 2
    error = capsys.readouterr().err
    assert f"libra: error: the gateway could not listen on 127.0.0.1:{port}" in error
    assert "Traceback" not in error
