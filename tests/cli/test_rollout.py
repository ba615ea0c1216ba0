"""``libra rollout``: rollouts end to end, and one clear line for bad input."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
import msgspec
import pytest

from envs_contrib.calc import Calc
from libra.cli import main
from libra.config import ConfigError, load_config
from libra.emulation import EmulatorConfig, LatencyModel, running_emulator
from libra.engine import TrajectoryRecord
from libra.launch import RolloutConfig, rollout
from libra.sched.policies import PrefixForest
from libra.serving import VLLMServer
from tests._helpers import DEMO, assert_tokens_consistent

if TYPE_CHECKING:
    import docker


def test_rollout_writes_one_exact_record_per_trajectory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "calc.jsonl"
    code = main(["rollout", "--env", "calc", "-n", "64", "--out", str(out), "--no-progress"])
    assert code == 0
    lines = out.read_bytes().splitlines()
    records = [msgspec.json.decode(line, type=TrajectoryRecord) for line in lines]
    assert len(records) == 64 and len({r.id for r in records}) == 64
    for record in records:
        assert record.status in ("completed", "truncated", "failed")
        assert_tokens_consistent(record, Calc.tool_schemas())
        for returned in record.tool_returns:
            assert returned.status in ("success", "failure", "timeout")
    summary = capsys.readouterr().out
    assert "64 trajectories" in summary and f"wrote 64 records to {out}" in summary
    calls = sum(len(r.tool_returns) for r in records)
    with_calls = sum(bool(r.tool_returns) for r in records)
    assert f"{calls} tool calls (" in summary and f"in {with_calls} of 64 trajectories" in summary


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["rollout", "--env", "nope"], "libra: error: unknown env 'nope'"),
        (["rollout", "--env", "calc", "-n", "0"], "libra: error: invalid config: n:"),
        (["rollout", "--env", "calc", "--server", "ftp://x"], "--server must be 'emulated'"),
        (["rollout", "--env", "calc", "--config", "missing.toml"], "config file not found"),
        (
            ["rollout", "--env", "calc", "--set", "engine.bogus=1"],
            "unknown key engine.bogus (valid keys of [engine]: concurrency",
        ),
        (
            ["rollout", "--env", "calc", "--server", "http://127.0.0.1:9"],
            "cannot reach http://127.0.0.1:9",
        ),
    ],
)
def test_bad_input_gives_one_line(args: list[str], message: str, tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "libra", *args, "--out", str(tmp_path / "o.jsonl")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


NAMED_ENV = """
from libra.envs import Env

class Echo(Env):
    name = "echo-env"

    def reset(self, seed: int) -> str:
        return "say hi"

    def reward(self, answer: str) -> float:
        return 1.0
"""


def run_script(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """``libra`` as its installed script runs: the current directory not on sys.path."""
    return subprocess.run(
        [sys.executable, "-P", "-m", "libra", *args], cwd=cwd, capture_output=True, text=True
    )


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("class Echo(Env)\n", "syntax error at {dir}/env_mod.py:1: expected ':'"),
        (
            "import socket\nfrom libra.envs import Env, tool\n"
            "class Echo(Env):\n    @tool\n    def send(self, to: socket.socket) -> str: ...\n",
            "tool send: parameter 'to' has type socket.socket, which has no JSON schema",
        ),
    ],
)
def test_an_env_that_cannot_load_gives_one_line_and_writes_nothing(
    tmp_path: Path, source: str, message: str
) -> None:
    (tmp_path / "env_mod.py").write_text(source)
    result = run_script(["rollout", "--env", "env_mod:Echo", "--out", "o.jsonl"], tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("libra: error: cannot load env 'env_mod:Echo': ")
    assert message.format(dir=tmp_path) in result.stderr
    assert len(result.stderr.splitlines()) == 1 and not (tmp_path / "o.jsonl").exists()


def test_an_env_in_the_current_directory_runs_under_its_own_name(tmp_path: Path) -> None:
    (tmp_path / "env_mod.py").write_text(NAMED_ENV)
    args = ["rollout", "--env", "env_mod:Echo", "-n", "2", "--no-progress", "--out", "o.jsonl"]
    result = run_script(args, tmp_path)
    assert result.returncode == 0, result.stderr
    records = [
        msgspec.json.decode(line) for line in (tmp_path / "o.jsonl").read_bytes().splitlines()
    ]
    assert [r["env"] for r in records] == ["echo-env"] * 2
    assert all(r["task_id"].startswith("echo-env/") for r in records)


class Flaky(Calc):
    """Calc whose odd seeds break in ``reset`` (a bug in the env: ``env_error``)."""

    def reset(self, seed: int) -> str:
        if seed % 2:
            raise RuntimeError(f"no task for seed {seed}")
        return super().reset(seed)


class Broken(Calc):
    def reset(self, seed: int) -> str:
        raise RuntimeError("no task")


def test_a_run_whose_every_trajectory_failed_exits_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "o.jsonl"
    argv = ["rollout", "--env", f"{__name__}:Broken", "-n", "4", "--no-progress"]
    assert main([*argv, "--out", str(out)]) == 1
    assert len(out.read_bytes().splitlines()) == 4  # the records are still written
    shown = capsys.readouterr().err.splitlines()
    assert shown[0].startswith("libra: a bug in env Broken: RuntimeError")  # its traceback, once
    assert shown.count("RuntimeError: no task") == 1
    assert shown[-1] == (
        "libra: error: all 4 trajectories failed (env_error: 4); the first: RuntimeError: no task"
    )


def test_max_failed_fraction_sets_how_many_failures_fail_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "o.jsonl"
    argv = ["rollout", "--env", f"{__name__}:Flaky", "-n", "16", "--no-progress"]
    assert main([*argv, "--out", str(out)]) == 0  # by default, only when every one failed
    lines = out.read_bytes().splitlines()
    records = [msgspec.json.decode(line, type=TrajectoryRecord) for line in lines]
    failed = sum(r.status == "failed" for r in records)
    assert 0 < failed < 16
    capsys.readouterr()
    fraction = (failed - 0.5) / 16
    assert main([*argv, "--out", str(out), "--max-failed-fraction", str(fraction)]) == 1
    assert f"libra: error: {failed} of 16 trajectories failed (env_error: {failed})" in (
        capsys.readouterr().err
    )
    fraction = (failed + 0.5) / 16
    assert main([*argv, "--out", str(out), "--max-failed-fraction", str(fraction)]) == 0


def test_sigterm_records_the_trajectories_in_flight(tmp_path: Path) -> None:
    out = tmp_path / "guess.jsonl"
    command = [sys.executable, "-m", "libra", "rollout", "--env", "guess", "-n", "5000"]
    options = ["--concurrency", "20", "--out", str(out), "--no-progress"]
    process = subprocess.Popen([*command, *options], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while (not out.exists() or out.stat().st_size == 0) and time.monotonic() < deadline:
        time.sleep(0.1)  # wait until trajectories are running
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 130, stderr
    records = [
        msgspec.json.decode(line, type=TrajectoryRecord) for line in out.read_bytes().splitlines()
    ]
    cancelled = [r for r in records if r.stop_reason == "cancelled"]
    assert len(cancelled) == 20  # exactly the ones in flight, each recorded once
    assert len({r.id for r in records}) == len(records) < 5000


def test_rollout_reads_tasks_from_a_jsonl_file(tmp_path: Path) -> None:
    tasks = tmp_path / "tasks.jsonl"
    rows = [{"key": "first", "seed": 11}, {"seed": 12, "payload": {"row": 1}}, {}]
    tasks.write_text("\n".join(json.dumps(row) for row in rows) + "\n\n")
    out = tmp_path / "out.jsonl"
    argv = ["rollout", "--env", "calc", "--tasks", str(tasks), "--samples-per-prompt", "2"]
    assert main([*argv, "--out", str(out), "--no-progress"]) == 0
    records = [
        msgspec.json.decode(line, type=TrajectoryRecord) for line in out.read_bytes().splitlines()
    ]
    assert Counter(r.task_id for r in records) == {"calc/first": 2, "calc/1": 2, "calc/2": 2}
    assert len({r.id for r in records}) == 6 and {r.step for r in records} == {0}
    assert {r.group_id for r in records} == {"calc/first@0", "calc/1@0", "calc/2@0"}
    prompts = {r.task_id: next(m.content for m in r.messages if m.role == "user") for r in records}
    seeds = {"calc/first": 11, "calc/1": 12, "calc/2": 2}  # a key's default is its index
    assert prompts == {task: Calc().reset(seed) for task, seed in seeds.items()}


def test_rollout_over_a_fleet_of_buckets_with_cmlfq(tmp_path: Path) -> None:
    config = EmulatorConfig(latency=LatencyModel.zero())
    with running_emulator(config) as short_url, running_emulator(config) as long_url:
        file = tmp_path / "fleet.toml"
        file.write_text(
            f"""
            env = "calc"
            n = 24
            scheduler = "cmlfq"
            metrics_interval_s = 0.05  # the router also reads the servers' /metrics
            plot = "{tmp_path / "progress.png"}"
            out = "{tmp_path / "out.jsonl"}"
            progress = false
            [[fleet.instances]]
            name = "small"
            url = "{short_url}"
            [[fleet.instances]]
            name = "large"
            url = "{long_url}"
            tp = 4
            [[fleet.buckets]]
            name = "short"
            max_tokens = 300
            instances = ["small"]
            [[fleet.buckets]]
            name = "long"
            max_tokens = 100000
            instances = ["large"]
            """
        )
        state = tmp_path / "forest.json"
        assert main(["rollout", "--config", str(file), "--set", f"scheduler_state={state}"]) == 0
        learnt = len(PrefixForest.load(state).global_tree.root.samples)
        rollout_config = load_config(RolloutConfig, file, {"scheduler_state": state})
        stats = anyio.run(rollout, rollout_config).stats  # what the first one learnt guides it
        assert len(PrefixForest.load(state).global_tree.root.samples) > learnt > 0
        state.write_text("{}")
        with pytest.raises(ConfigError, match="is not a saved prefix forest"):
            anyio.run(rollout, rollout_config)
    records = [
        msgspec.json.decode(line, type=TrajectoryRecord)
        for line in (tmp_path / "out.jsonl").read_bytes().splitlines()
    ]
    assert stats.done == len(records) == 24 and stats.statuses["failed"] == 0
    assert (tmp_path / "progress.png").read_bytes().startswith(b"\x89PNG")
    for record in records:  # every turn ran on an instance of the fleet, by its name
        assert len(record.endpoints) == record.turns
        assert set(record.endpoints) <= {"small", "large"}
    with pytest.raises(ConfigError, match="unknown scheduler 'oracle'"):
        load_config(RolloutConfig, file, overrides=["scheduler=oracle"])


@pytest.mark.slow
def test_the_demo_runs_on_a_running_libra_serve_with_docker_tools(
    real_server: VLLMServer,
    docker_client: docker.DockerClient,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("LIBRA_HOME", str(tmp_path))
    (tmp_path / "run").mkdir()
    state = {"url": real_server.url, "pid": os.getpid()}  # as `libra vllm` records itself
    (tmp_path / "run" / "embedded.json").write_text(json.dumps(state))
    out, plot = tmp_path / "demo.jsonl", tmp_path / "demo.png"
    args = ["rollout", "--config", str(DEMO), "-n", "4", "--out", str(out), "--plot", str(plot)]
    args += ["--sandbox", "docker", "--no-progress", "--set", "engine.max_turns=3"]
    args += ["--set", "engine.sampling.max_tokens_per_turn=128"]
    assert main(args) == 0
    lines = out.read_bytes().splitlines()
    records = [msgspec.json.decode(line, type=TrajectoryRecord) for line in lines]
    assert len(records) == 4 and all(r.status != "failed" for r in records), records
    assert all(r.tokens == "exact" and r.endpoints[0] == "embedded" for r in records)
    assert any(r.tool_returns for r in records)  # programs ran in containers
    assert plot.read_bytes().startswith(b"\x89PNG")
    assert "starting vLLM" not in capsys.readouterr().err  # it reused the running server
