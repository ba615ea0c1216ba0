"""``libra serve`` as a user runs it: a subprocess on a loopback port over the emulated
fleet, driven by the official ``openai`` SDK (sync, streaming and not, tool calls), with
API keys, recording, a client that gives up, and the refusals of bad settings; and over
the embedded vLLM, killed under it and restarted (slow)."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import anyio
import httpx2
import msgspec
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam
from rich.console import Console

from libra.cli import main
from libra.cli._serve import console_view
from libra.config import ConfigError, RenamedWarning, load_config
from libra.engine import TrajectoryRecord
from libra.events import EventBus
from libra.gateway import GatewayConfig, GatewayMetrics, Keys, Sessions, create_gateway
from libra.launch import ServeConfig
from tests._helpers import (
    CALCULATOR,
    MODEL,
    REAL_MODEL_NAME,
    SERVE_ADMIN_KEY,
    SERVE_USER_KEY,
    children_of,
    cmdline_of,
    emulated_engine,
    is_alive,
    libra_serve,
)

ROOT = Path(__file__).parents[2]
USER_KEY, ADMIN_KEY = SERVE_USER_KEY, SERVE_ADMIN_KEY
TOOLS: list[ChatCompletionToolParam] = [CALCULATOR]  # type: ignore[list-item]


def test_an_sdk_agent_with_tools_is_served_streamed_and_recorded(tmp_path: Path) -> None:
    record = tmp_path / "sessions.jsonl"
    with ExitStack() as stack:
        url = stack.enter_context(libra_serve("--record", str(record), "--scheduler", "cmlfq"))
        sdk = stack.enter_context(
            openai.OpenAI(base_url=f"{url}/v1", api_key=USER_KEY, max_retries=0)
        )
        session = {"X-Libra-Session": "agent-1"}
        messages: list[ChatCompletionMessageParam] = [
            {"role": "system", "content": "Use the calculator."},
            {"role": "user", "content": "What is 6 times 7?"},
        ]
        turns = 0
        while turns < 4:  # the emulated agent calls the tool, then answers
            turns += 1
            reply = sdk.chat.completions.create(
                model=MODEL, messages=messages, tools=TOOLS, extra_headers=session
            )
            message = reply.choices[0].message
            messages.append(message.model_dump(exclude_unset=True))  # type: ignore[arg-type]
            if not message.tool_calls:
                break
            for call in message.tool_calls:
                messages.append({"role": "tool", "tool_call_id": call.id, "content": "42"})
        assert turns >= 2 and reply.choices[0].finish_reason == "stop"
        with sdk.chat.completions.create(
            model=MODEL, messages=messages[:2], tools=TOOLS, stream=True
        ) as stream:
            chunks = list(stream)
        assert chunks[0].choices[0].delta.role == "assistant"
        assert chunks[-1].choices[0].finish_reason in ("stop", "tool_calls")
        report = {"session": "agent-1", "reward": 1.0, "done": True}
        sdk.post("/libra/report", body=report, cast_to=dict)
        assert [m.id for m in sdk.models.list()] == [MODEL]
        auth = {"Authorization": f"Bearer {USER_KEY}"}
        scraped = httpx2.get(f"{url}/metrics", headers=auth).text
    # /metrics counts each call upstream from the engine's events (the bus is always on).
    calls = [line for line in scraped.splitlines() if line.startswith("libra_gateway_bucket_req")]
    assert sum(float(line.rsplit(" ", 1)[1]) for line in calls) == turns + 1
    assert all('outcome="ok"' in line for line in calls)
    records = [
        msgspec.json.decode(line, type=TrajectoryRecord) for line in record.read_text().splitlines()
    ]
    # The agent's session, reported done; the streamed one ended with the server.
    done = [r for r in records if r.status == "completed"]
    assert [(r.reward, r.turns, r.stop_reason) for r in done] == [(1.0, turns, "done")]
    assert len(records) == 2 and all(r.tokens == "exact" for r in records)


def test_keys_are_required_and_the_admin_api_takes_only_the_admin_key() -> None:
    with libra_serve() as url:
        with (
            openai.OpenAI(base_url=f"{url}/v1", api_key="guess", max_retries=0) as sdk,
            pytest.raises(openai.AuthenticationError),
        ):
            sdk.models.list()
        user = {"Authorization": f"Bearer {USER_KEY}"}
        admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
        assert httpx2.get(f"{url}/admin/status", headers=user).status_code == 403
        status = httpx2.get(f"{url}/admin/status", headers=admin).json()
        assert status["paused"] is False and all(status["healthy"].values())


def test_a_client_that_gives_up_cancels_its_call_upstream() -> None:
    slow = ["emulator.latency.step_base_s=0.05", "emulator.latency.step_per_seq_s=0"]
    with libra_serve(settings=slow) as url:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell a long story"}]}
        auth = {"Authorization": f"Bearer {USER_KEY}"}
        with pytest.raises(httpx2.ReadTimeout):
            httpx2.post(f"{url}/v1/chat/completions", json=body, headers=auth, timeout=0.5)
        metrics = ""
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            metrics = httpx2.get(f"{url}/metrics", headers=auth).text
            if 'libra_gateway_disconnects_total{route="chat"} 1.0' in metrics:
                break
            time.sleep(0.1)
        assert 'libra_gateway_disconnects_total{route="chat"} 1.0' in metrics
        in_flight = [line for line in metrics.splitlines() if "upstream_in_flight{" in line]
        assert in_flight and all(line.endswith(" 0.0") for line in in_flight), in_flight


def _vllm_under(pid: int) -> list[int]:
    """The vLLM API servers ``pid`` runs (each its guard's child)."""
    guards = [child for child in children_of(pid) if "_guard.py" in cmdline_of(child)]
    return [server for guard in guards for server in children_of(guard)]


@pytest.mark.faults
@pytest.mark.slow
def test_an_embedded_vllm_killed_under_libra_serve_is_restarted_and_serves_again(
    embedded_model: Path, tmp_path: Path
) -> None:
    """``--server embedded`` starts vLLM for the gateway (no ``libra vllm`` runs under
    this ``LIBRA_HOME``); SIGKILLed, it is restarted, and the gateway answers again."""
    (tmp_path / "models").symlink_to(embedded_model.parent)  # the model, not a rebuild
    started: list[int] = []
    messages = [{"role": "user", "content": "Hi"}]
    body: dict[str, object] = {"model": REAL_MODEL_NAME, "messages": messages, "max_tokens": 8}
    auth = {"Authorization": f"Bearer {USER_KEY}"}
    with libra_serve(server="embedded", settings=[], home=tmp_path, started=started) as url:
        chat = f"{url}/v1/chat/completions"
        assert httpx2.post(chat, json=body, headers=auth, timeout=120).status_code == 200
        (first,) = _vllm_under(started[0])
        os.kill(first, signal.SIGKILL)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            again = [pid for pid in _vllm_under(started[0]) if pid != first]
            if again and httpx2.get(f"{url}/health", timeout=10).status_code == 200:
                break
            time.sleep(1)
        else:
            pytest.fail("the killed vLLM was not restarted")
        assert not is_alive(first)
        reply = httpx2.post(chat, json=body, headers=auth, timeout=120)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"]["role"] == "assistant"


@pytest.mark.parametrize(
    ("flags", "error"),
    [
        (["--no-auth", "--host", "0.0.0.0"], "--no-auth is allowed only on a loopback"),
        (["--scheduler", "fastest"], "unknown scheduler 'fastest'"),
        (["--policy", "fastest"], "libra: warning: libra serve --policy is now --scheduler"),
    ],
)
def test_bad_settings_are_refused_before_anything_starts(flags: list[str], error: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "LIBRA_API_KEY"}
    done = subprocess.run(
        [sys.executable, "-m", "libra", "serve", *flags],
        env={**env, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and error in done.stderr


def test_without_a_key_libra_serve_says_how_to_give_one() -> None:
    env = {k: v for k, v in os.environ.items() if k != "LIBRA_API_KEY"}
    done = subprocess.run(
        [sys.executable, "-m", "libra", "serve"],
        env={**env, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "LIBRA_API_KEY" in done.stderr
    assert "Traceback" not in done.stderr


def test_the_example_config_is_a_valid_serve_config() -> None:
    config = load_config(ServeConfig, ROOT / "examples" / "serve.toml", {}, ["port=9000"])
    assert config.scheduler == "cmlfq" and config.port == 9000 and config.fleet is not None
    assert [b.name for b in config.fleet.buckets] == ["short", "long"]
    assert config.gateway.session_ttl_s == 300


def test_policy_is_the_old_name_of_scheduler_for_one_release(tmp_path: Path) -> None:
    file = tmp_path / "serve.toml"
    file.write_text('policy = "sorted"\n')
    with pytest.warns(RenamedWarning, match="^policy is now scheduler"):
        assert load_config(ServeConfig, file).scheduler == "sorted"
    with pytest.raises(ConfigError, match="policy and scheduler are one setting"):
        load_config(ServeConfig, file, {"scheduler": "cmlfq"})
    with pytest.warns(RenamedWarning, match="--policy is now --scheduler"):
        code = main(["serve", "--policy", "fastest"])  # the config is checked before serving
    assert code == 2


@pytest.mark.anyio
async def test_the_console_line_counts_requests_sessions_and_tokens() -> None:
    async with (
        emulated_engine(["Hello there."], events=(bus := EventBus())) as (engine, _),
        Sessions(engine, GatewayConfig()) as core,
    ):
        metrics = GatewayMetrics(engine.scheduler.router, bus)
        app = create_gateway(core, Keys.of([], [], enabled=False), metrics=metrics)
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
        async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app)) as http:
            response = await http.post("http://gateway/v1/chat/completions", json=body)
        assert response.status_code == 200
        screen = io.StringIO()
        console = Console(file=screen, force_terminal=True, width=200, color_system=None)
        with anyio.move_on_after(0.35):
            await console_view(metrics, core, 0.1, console)
    line = [text for text in screen.getvalue().splitlines() if "libra serve" in text][-1]
    assert "libra serve 1 requests" in line and "0 errors" in line and "1 sessions" in line
    assert "0 upstream calls" in line
    assert metrics.totals.prompt_tokens > 0 and metrics.totals.completion_tokens > 0
    assert f"{metrics.totals.completion_tokens} completion tokens" in line
