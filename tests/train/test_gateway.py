"""``libra train --serve URL`` through a real ``libra serve`` gateway (a subprocess on a
loopback port over the emulated fleet): rollouts through its OpenAI surface with exact
records, weight syncs through its admin API, and the one line a refused key gets."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import httpx
import pytest

from libra.emulation import AgentScript, EmulatorConfig, LatencyModel, running_emulator
from libra.gateway import ADMIN_HEADER as GATEWAY_ADMIN_HEADER
from libra.launch import TrainRunConfig, train
from libra.train import iter_metrics
from libra.train._gateway import ADMIN_HEADER, ADMIN_KEY_VAR, find_gateway
from tests._helpers import (
    BREVITY,
    SERVE_ADMIN_KEY,
    SERVE_USER_KEY,
    ZERO_LATENCY,
    libra_serve,
    tiny_llama,
)

ROOT = Path(__file__).parents[2]
USER_KEY, ADMIN_KEY = SERVE_USER_KEY, SERVE_ADMIN_KEY


def gateway(server: str = "emulated", *settings: str) -> AbstractContextManager[str]:
    """``libra serve`` routing by C-MLFQ, over an emulator whose agent thinks briefly."""
    think = "emulator.agent.think_tokens=[0, 40]"
    return libra_serve(
        "--scheduler", "cmlfq", server=server, settings=[*ZERO_LATENCY, think, *settings]
    )


@pytest.fixture(scope="module")
def gateway_url() -> Iterator[str]:
    with gateway() as url:
        yield url


def run_config(run_dir: Path, model_dir: Path, serve: str) -> TrainRunConfig:
    data: dict[str, Any] = {
        "rollout": {
            "env": BREVITY,
            "engine": {"concurrency": 8, "sampling": {"max_tokens_per_turn": 48, "seed": 0}},
        },
        "serve": serve,
        "model": str(model_dir),
        "steps": 2,
        "prompts_per_step": 2,
        "samples_per_prompt": 3,
        "run_dir": str(run_dir),
        "trainer": {"lr": 1e-3, "cpu_threads": 1, "backend": "gloo"},
    }
    return TrainRunConfig.model_validate(data)


@pytest.mark.anyio
async def test_two_steps_through_the_gateway_sync_its_fleet_and_record_exact_tokens(
    gateway_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ADMIN_KEY_VAR, ADMIN_KEY)
    config = run_config(tmp_path / "run", tiny_llama(tmp_path / "model"), gateway_url)
    lines = await train(config)

    assert [line.weight_version for line in lines] == [1, 2]
    assert [w["step"] for w in iter_metrics(config.run_dir)] == [0, 1]
    for line in lines:
        assert line.trajectories == 6 and line.statuses.get("failed", 0) == 0
        assert line.tokens_trained > 0 and line.sync_s > 0
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    async with httpx.AsyncClient(base_url=gateway_url, headers=admin) as http:
        status = (await http.get("/admin/status")).json()
        metrics = (await http.get("/metrics")).text
    assert set(status["versions"].values()) == {2} and status["paused"] is False
    # The rollouts went through the gateway's OpenAI surface, rendered by its /tokenize.
    assert 'route="completions",status="200"' in metrics, metrics
    assert 'route="tokenize",status="200"' in metrics
    for step in (0, 1):
        lines_of_step = (config.run_dir / "rollouts" / f"step-{step}.jsonl").read_text()
        records = [json.loads(line) for line in lines_of_step.splitlines()]
        assert len(records) == 6 and {r["weight_version"] for r in records} == {step}
        for record in records:
            assert record["tokens"] == "exact"
            sampled = [i for i, mask in enumerate(record["loss_mask"]) if mask]
            assert sampled and all(record["logprobs"][i] is not None for i in sampled)


@pytest.mark.parametrize(("key", "says"), [("wrong-key", "refused"), (None, "set")])
def test_a_missing_or_refused_admin_key_is_one_line_and_exit_status_1(
    gateway_url: str, tmp_path: Path, key: str | None, says: str
) -> None:
    env = {k: v for k, v in os.environ.items() if k != ADMIN_KEY_VAR}
    env["PYTHONPATH"] = str(ROOT)
    if key is not None:
        env[ADMIN_KEY_VAR] = key
    command = [sys.executable, "-m", "libra", "train", "--serve", gateway_url, "--no-progress"]
    command += ["--run-dir", str(tmp_path / "run"), "--set", f"rollout.env={BREVITY}"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)

    assert done.returncode == 1, done.stderr
    errors = done.stderr.strip().splitlines()
    assert len(errors) == 1 and errors[0].startswith("libra: error: "), done.stderr
    assert gateway_url in errors[0] and ADMIN_KEY_VAR in errors[0] and says in errors[0]
    assert ADMIN_KEY not in done.stderr and "wrong-key" not in done.stderr


@pytest.mark.slow
def test_a_weight_sync_that_fails_at_the_gateway_is_one_line_and_exit_status_1(
    tmp_path: Path,
) -> None:
    """The gateway's upstream (a real port) does not answer the reload in time: the run
    stops after its first step with the gateway's reason, in one line."""
    upstream = EmulatorConfig(latency=LatencyModel.zero(), agent=AgentScript(think_tokens=(0, 40)))
    config = run_config(tmp_path / "run", tiny_llama(tmp_path / "model"), "")
    with (
        running_emulator(upstream) as server,
        gateway(server, "gateway.weight_sync.timeout_s=1e-06") as url,
    ):
        config_file = tmp_path / "train.toml"
        config_file.write_text(config.model_copy(update={"serve": url}).to_toml())
        env = {**os.environ, "PYTHONPATH": str(ROOT), ADMIN_KEY_VAR: ADMIN_KEY}
        command = [sys.executable, "-m", "libra", "train", "--config", str(config_file)]
        done = subprocess.run(
            [*command, "--no-progress"], env=env, capture_output=True, text=True, timeout=300
        )

    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    # One line says why (the lines above it are the trainer's progress bars).
    errors = [line for line in done.stderr.splitlines() if line.startswith("libra: ")]
    assert errors == [done.stderr.strip().splitlines()[-1]], done.stderr
    assert errors[0].startswith("libra: error: "), done.stderr
    assert "/admin/reload_weights" in errors[0] and "502" in errors[0], errors[0]


@pytest.mark.anyio
async def test_a_gateway_is_found_by_its_admin_api_and_a_plain_server_is_not(
    gateway_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ADMIN_KEY_VAR, ADMIN_KEY)
    found = await find_gateway(f"{gateway_url}/v1")
    assert found is not None and found.url == gateway_url
    versions = await found.versions()  # one upstream, at whatever version the run left
    assert len(versions) == 1 and ADMIN_HEADER == GATEWAY_ADMIN_HEADER
    with running_emulator() as plain:  # an OpenAI server that is no gateway
        assert await find_gateway(plain) is None
    async with httpx.AsyncClient() as http:
        answer = await http.get(f"{gateway_url}/admin/status")
    assert answer.status_code == 401 and ADMIN_HEADER in answer.headers
