"""``libra bench sched``: the workload's env and model agree, runs repeat exactly, and
the command prints what the issue asks for."""

from __future__ import annotations

import json
from pathlib import Path

import anyio
import pytest
from trio.testing import MockClock

from libra.bench._sched import (
    PolicyRun,
    lower_bound,
    run_policy,
    run_sched_bench,
    signal_of,
)
from libra.bench._sched_fleet import load_fleet
from libra.cli import main
from libra.emulation import EmulatorConfig, create_app
from libra.emulation.workloads import ScriptBook, load_workload
from libra.emulation.workloads._env import EnvClasses, WorkloadScript, tool_output
from libra.engine import (
    Engine,
    EngineConfig,
    OpenAIClient,
    SamplingConfig,
    TrajectoryJob,
    TrajectoryRecord,
    rollout,
)
from libra.engine._asgi import ASGITransport
from libra.fleet import Endpoint
from libra.sched.policies import LeastLoadedScheduler
from libra.signals import size_class

from .test_sched_workloads import USER_WORKLOAD

TINY = (
    USER_WORKLOAD.replace("prompts = 24", "prompts = 6")
    .replace("samples_per_prompt = 4", "samples_per_prompt = 3")
    .replace("max_turns = 10", "max_turns = 5")
)


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.toml"
    path.write_text(TINY)
    return path


def test_the_env_and_the_emulated_model_play_the_same_script(tiny: Path) -> None:
    workload = load_workload(str(tiny))
    book = ScriptBook(workload, seed=5)
    scripts = book.step(1)
    fleet = load_fleet()
    records: list[TrajectoryRecord] = []

    async def play() -> None:
        config = EmulatorConfig(model_name="m", latency=fleet.latency(2), prefix_caching=True)
        app = create_app(config, WorkloadScript(book))
        endpoint = Endpoint("http://solo", model="m", api="tokens")
        engine_config = EngineConfig(
            max_context_tokens=20000,
            tool_timeout_s=workload.limits.tool_timeout_s,
            sampling=SamplingConfig(max_tokens_per_turn=8000, seed=5),
        )
        classes = EnvClasses(book)
        jobs = [
            TrajectoryJob(classes(1, s.sample), workload.name, s.task_seed, s.sample)
            for s in scripts
        ]
        async with ASGITransport(app) as http:
            scheduler = LeastLoadedScheduler([endpoint])
            engine = Engine(OpenAIClient(http), scheduler, config=engine_config)
            await rollout(jobs, engine, on_record=records.append)

    anyio.run(play, backend="trio", backend_options={"clock": MockClock(autojump_threshold=0)})
    by_id = {record.id: record for record in records}
    for script in scripts:
        record = by_id[script.trajectory_id]
        assert record.status == "completed" and record.tokens == "exact"
        assert record.turns == len(script.turns)
        assert sum(record.loss_mask) == script.output_tokens
        scripted = [turn for turn in script.turns if turn.tool is not None]
        assert [r.tool for r in record.tool_returns] == [t.tool for t in scripted]
        for returned, turn in zip(record.tool_returns, scripted, strict=True):
            expected = signal_of(turn, workload.limits.tool_timeout_s)
            assert (returned.status, returned.size_class) == (
                expected.status,
                expected.size_class,
            )
        assert record.reward == (1.0 if script.solved else 0.0)
    assert any(r.status == "timeout" for rec in records for r in rec.tool_returns) or all(
        t.status != "timeout" for s in scripts for t in s.turns
    )


def test_a_failed_check_reads_as_a_failure_of_the_scripted_size() -> None:
    from libra.emulation.workloads import ScriptTurn

    failed = ScriptTurn(500, "run_sql", "failure", 1200, 1.0)
    content = tool_output(failed)
    assert len(content) == 1200 and content.startswith("Traceback (most recent call last)")
    assert size_class(len(content)) == "medium"


def _makespans(runs: list[PolicyRun]) -> dict[str, float]:
    return {run.policy: run.makespan_s for run in runs}


@pytest.mark.slow
def test_the_bench_repeats_exactly_for_a_seed_and_respects_the_bound(tiny: Path) -> None:
    workload, fleet = load_workload(str(tiny)), load_fleet()
    policies = ["round-robin", "cmlfq", "oracle", "oracle-finish"]
    first = run_sched_bench(workload, fleet, policies, seed=3)
    again = run_sched_bench(workload, fleet, policies, seed=3, jobs=2)  # other processes too
    assert first.as_json() == again.as_json()
    assert _makespans(run_sched_bench(workload, fleet, ["cmlfq"], seed=4).runs) != {
        "cmlfq": _makespans(first.runs)["cmlfq"]
    }
    for result in first.results:
        assert result.failed == 0 and result.trajectories == 18
        assert result.vs_bound >= 1.0 and 0.0 <= result.idle_frac < 1.0
    oracle = next(r for r in first.results if r.policy == "oracle")
    assert oracle.vs_oracle == 1.0


def test_the_lower_bound_is_the_larger_of_the_longest_chain_and_the_work(tiny: Path) -> None:
    workload, fleet = load_workload(str(tiny)), load_fleet()
    scripts = ScriptBook(workload).step(1)
    bound = lower_bound(scripts, fleet, workload.limits.tool_timeout_s)
    assert bound.seconds == max(bound.chain_s, bound.work_s) > 0
    longest_tools = max(s.tool_s for s in scripts)
    assert bound.chain_s >= longest_tools
    run = run_policy(workload, fleet, "oracle-finish", seed=0)
    assert run.makespan_s >= bound.seconds
    assert run.output_tokens == sum(s.output_tokens for s in scripts)
    assert set(run.occupancy) == {"short", "medium", "long"}


def test_the_command_prints_the_json_the_issue_asks_for(
    tiny: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["bench", "sched", "--workload", str(tiny), "--policies", "least-loaded,oracle"]
    assert main([*argv, "--json", "--jobs", "1", "--seed", "2"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["workload"] == "data-agent" and report["lower_bound_s"] > 0
    assert [r["policy"] for r in report["results"]] == ["least-loaded", "oracle"]
    keys = {"policy", "throughput_traj_s", "throughput_tok_s", "makespan_s", "idle_frac"}
    for result in report["results"]:
        assert keys | {"vs_oracle", "vs_bound"} <= set(result)


@pytest.mark.slow
def test_the_command_prints_a_table_and_draws_the_plot(
    tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    picture = tmp_path / "sched.png"
    argv = ["bench", "sched", "--workload", str(tiny), "--policies", "cmlfq,sorted"]
    assert main([*argv, "--jobs", "1", "--plot", str(picture)]) == 0
    out = capsys.readouterr().out
    for text in ("cmlfq", "sorted", "makespan s", "x bound", "lower bound"):
        assert text in out
    assert picture.read_bytes().startswith(b"\x89PNG")


def test_bad_arguments_are_one_line_errors(tiny: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "sched", "--workload", "nope", "--jobs", "1"]) == 2
    assert "unknown name 'nope'" in capsys.readouterr().err
    assert main(["bench", "sched", "--workload", str(tiny), "--policies", "fifo"]) == 2
    assert "unknown policies fifo" in capsys.readouterr().err
