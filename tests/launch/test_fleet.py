"""Opening a fleet: the rules on what a run may name."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import pytest
from anyio.abc import SocketAttribute, SocketStream

from libra.cli import main
from libra.emulation import ByteTokenizer, EmulatorConfig, LatencyModel
from libra.engine import Engine
from libra.launch import (
    FleetError,
    RolloutConfig,
    build_scheduler,
    local_templates,
    open_fleet,
    rollout,
)
from libra.sched.policies import CMLFQConfig


def test_a_fleet_and_a_server_are_exclusive(tmp_path: Path) -> None:
    fleet = {"instances": [{"name": "a", "url": "http://127.0.0.1:9"}]}
    config = RolloutConfig(env="calc", server="emulated", fleet=fleet, out=tmp_path / "o.jsonl")
    with pytest.raises(FleetError, match="either --server or a"):
        anyio.run(rollout, config)


@asynccontextmanager
async def tcp_server(answer: bytes | None) -> AsyncIterator[str]:
    """A loopback server that reads a request and answers ``answer`` (or never does)."""

    async def handle(stream: SocketStream) -> None:
        async with stream:
            await stream.receive()
            if answer is None:
                await anyio.sleep_forever()
            else:
                await stream.send(answer)

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(SocketAttribute.local_port)
    async with listener, anyio.create_task_group() as group:
        group.start_soon(listener.serve, handle)
        yield f"http://127.0.0.1:{port}"
        group.cancel_scope.cancel()


def http_answer(status: str, body: bytes, kind: str = "text/html") -> bytes:
    head = f"HTTP/1.1 {status}\r\nContent-Type: {kind}\r\nContent-Length: {len(body)}\r\n"
    return head.encode() + b"Connection: close\r\n\r\n" + body


async def open_url(url: str, model: str | None = None) -> None:
    async with open_fleet(
        url, model=model, transport="httpx", max_connections=4, probe_timeout_s=0.5
    ):
        pass


@pytest.mark.anyio
@pytest.mark.parametrize("model", [None, "given"])
async def test_a_server_that_never_answers_is_named_with_the_time_waited(
    model: str | None,
) -> None:
    async with tcp_server(None) as url:
        started = anyio.current_time()
        with pytest.raises(FleetError) as raised:
            await open_url(url, model)
    assert anyio.current_time() - started < 3
    message = f"{url} never answered: no reply to GET /v1/models in 0.5 s"
    assert str(raised.value).startswith(message)


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("answer", "message"),
    [
        (
            http_answer("404 Not Found", b"<html><body>Not here</body></html>"),
            "is not an OpenAI-compatible server: GET /v1/models answered HTTP 404 "
            "('<html><body>Not here</body></html>')",
        ),
        (
            http_answer("200 OK", b"hello, world"),
            "is not an OpenAI-compatible server: GET /v1/models answered 'hello, world', "
            "not a model list",
        ),
        (http_answer("200 OK", b'{"data": []}', "application/json"), "lists no model"),
    ],
)
async def test_a_server_that_is_not_openai_compatible_says_what_it_answered(
    answer: bytes, message: str
) -> None:
    async with tcp_server(answer) as url:
        with pytest.raises(FleetError, match=re.escape(message)):
            await open_url(url, "given")


@pytest.mark.anyio
async def test_every_failing_server_of_a_fleet_is_named_at_once() -> None:
    async with tcp_server(None) as silent, tcp_server(http_answer("200 OK", b"hi")) as other:
        started = anyio.current_time()
        with pytest.raises(FleetError) as raised:
            await open_url(f"{silent},{other}")
    assert anyio.current_time() - started < 3  # asked at once, not one after the other
    assert f"{silent} never answered" in str(raised.value)
    assert f"{other} is not an OpenAI-compatible server" in str(raised.value)


def test_the_command_says_so_in_one_line_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    async def rollout_against_a_silent_server() -> int:
        async with tcp_server(None) as url:
            argv = ["rollout", "--env", "guess", "--server", url, "--set", "probe_timeout_s=0.3"]
            out = ["--out", str(tmp_path / "o.jsonl")]
            return await anyio.to_thread.run_sync(main, [*argv, *out])

    assert anyio.run(rollout_against_a_silent_server) == 2
    error = capsys.readouterr().err
    assert error.startswith("libra: error: http://127.0.0.1:") and error.count("\n") == 1
    assert "never answered: no reply to GET /v1/models in 0.3 s" in error
    assert list(tmp_path.iterdir()) == []


@pytest.mark.anyio
@pytest.mark.parametrize("renders_tools", [True, False])
async def test_the_emulators_template_renders_in_process_whether_it_shows_tools_or_not(
    renders_tools: bool,
) -> None:
    emulator = EmulatorConfig(latency=LatencyModel.zero(), template_renders_tools=renders_tools)
    opening = open_fleet(
        "emulated", model=None, transport="aiohttp", max_connections=8, emulator=emulator
    )
    async with opening as fleet:
        scheduler = build_scheduler("least-loaded", fleet.spec, CMLFQConfig())
        engine = Engine(fleet.http, scheduler, templates=local_templates())
        endpoint = scheduler.router.instances[0].endpoint
        found = await engine.renderer.local_template(endpoint)
    assert found is not None  # one of the two, whichever the server's template is
    assert isinstance(found, ByteTokenizer) == renders_tools
