"""The emulated server on a real port, its command line, and its life bound to its parent's."""

from __future__ import annotations

import subprocess
import sys
import time

import anyio
import httpx
import msgspec
import pytest

from libra.emulation import EmulatorConfig, EmulatorServer, LatencyModel, running_emulator
from libra.emulation._serve import build_parser, config_from_args
from libra.openai import ChatCompletion
from tests._helpers import CALCULATOR, MODEL, QUESTION


def test_real_port_round_trip() -> None:
    config = EmulatorConfig(latency=LatencyModel(step_base_s=0.001, prefill_s_per_token=0.0))
    with running_emulator(config) as url, httpx.Client(base_url=url) as client:
        assert client.get("/health").status_code == 200
        body = {"model": MODEL, "messages": QUESTION, "tools": [CALCULATOR]}
        response = client.post("/v1/chat/completions", json={**body, "return_token_ids": True})
        completion = msgspec.json.decode(response.content, type=ChatCompletion)
        metrics = client.get("/metrics").text
    tokens = completion.choices[0].token_ids or []
    assert tokens and completion.usage is not None
    assert completion.usage.completion_tokens == len(tokens)
    assert f'vllm:generation_tokens_total{{model_name="{MODEL}"}} {float(len(tokens))}' in metrics
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{url}/health", timeout=1.0)  # the server is gone


def test_command_line_options_make_a_config() -> None:
    args = build_parser().parse_args(
        ["--latency", "zero", "--script", "echo", "--seed", "3", "--think-tokens", "2", "9"]
    )
    config = config_from_args(args)
    assert config.latency.is_zero and config.script == "echo" and config.seed == 3
    assert config.agent.think_tokens == (2, 9)
    faults = ["--stall-rate", "0.1", "--abort-rate", "0.2", "--http-garbage-rate", "0.3"]
    faulty = config_from_args(build_parser().parse_args([*faults, "--die-after", "7"]))
    assert (faulty.stall_rate, faulty.abort_rate, faulty.garbage_rate) == (0.1, 0.2, 0.3)
    assert faulty.die_after == 7 and faulty.die_rate == 0.0
    whole = EmulatorConfig(seed=11, error_rate=0.5)
    assert (
        config_from_args(build_parser().parse_args(["--config-json", whole.model_dump_json()]))
        == whole
    )


def test_server_exits_when_its_parent_dies() -> None:
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time\n"
            "from libra.emulation import running_emulator\n"
            "with running_emulator() as url:\n"
            "    print(url, flush=True)\n"
            "    time.sleep(120)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    with parent:
        assert parent.stdout is not None
        url = parent.stdout.readline().strip()
        assert httpx.get(f"{url}/health").status_code == 200
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            httpx.get(f"{url}/health", timeout=0.5)
        except httpx.TransportError:
            return
        time.sleep(0.1)
    pytest.fail("the emulated server outlived its parent")


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_restarted_server_keeps_its_address() -> None:
    server = EmulatorServer()
    await server.astart()
    try:
        url = server.url
        server.kill()
        with anyio.fail_after(5):
            await server.wait_exited()
        await server.astop()
        await server.astart()
        assert server.url == url and server.starts == 2
        async with httpx.AsyncClient() as client:
            assert (await client.get(f"{url}/health")).status_code == 200
    finally:
        await server.astop()
