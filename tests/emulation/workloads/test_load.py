"""Workload and fleet files: the shipped ones, a user's own, validation, scripts."""

from __future__ import annotations

from pathlib import Path

import pytest

from libra.bench._sched_fleet import load_fleet
from libra.emulation.workloads import (
    ScriptBook,
    TrajectoryScript,
    Workload,
    WorkloadError,
    available_workloads,
    draw_script,
    load_workload,
)

# Written from libra/emulation/workloads/README.md alone: a data-analysis agent that inspects
# tables, then runs a query whose result it checks; a wrong query returns an error.
USER_WORKLOAD = """
name = "data-agent"
description = "inspect tables, run SQL until the answer checks out"
sources = ["made up for a test"]

[rollout]
prompts = 24
samples_per_prompt = 4
history_steps = 1
drift_per_step = 0.05

[limits]
max_turns = 10
max_context_tokens = 16384
tool_timeout_s = 30

[prompt_tokens]
median = 600
sigma = 0.3
max = 2000

[solve_rate]
alpha = 1.0
beta = 1.5
give_up = 0.1

[turn]
tokens = { median = 500, sigma = 0.6, min = 96, max = 3000 }
final_tokens = { median = 200, sigma = 0.4, min = 20 }
growth_after_failure = 1.2

[[explore]]
name = "describe_table"
description = "Show a table's columns and a few rows."
calls_first_attempt = [1, 2]
calls_later_attempts = [0, 1]
latency_s = { median = 0.2, sigma = 0.3 }
output = { status = "success", chars = { median = 1500, sigma = 0.5 } }

[check]
name = "run_sql"
description = "Run a SQL query and return its result."
latency_s = { median = 2.0, sigma = 0.8 }
timeout_probability = 0.02
on_pass = { status = "success", chars = { median = 400, sigma = 0.5 } }
on_fail = { status = "failure", chars = { median = 1200, sigma = 0.4 } }
"""


def write(tmp_path: Path, text: str, name: str = "workload.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_the_shipped_workloads_load_and_cite_their_sources() -> None:
    assert {"swe-agent", "search-agent", "math-code"} <= set(available_workloads())
    for name in available_workloads():
        workload = load_workload(name)
        assert workload.name == name and workload.sources and workload.description


def test_a_workload_written_from_the_documentation_loads_and_plays(tmp_path: Path) -> None:
    workload = load_workload(str(write(tmp_path, USER_WORKLOAD)))
    assert workload.name == "data-agent" and workload.tool_names == ["describe_table", "run_sql"]
    scripts = ScriptBook(workload).step(1)
    assert len(scripts) == 96
    assert {turn.tool for s in scripts for turn in s.turns} == {"describe_table", "run_sql", None}
    assert any(turn.status == "failure" for s in scripts for turn in s.turns)


def test_scripts_are_deterministic_per_seed_and_stay_in_the_limits() -> None:
    workload = load_workload("swe-agent")
    first, again = ScriptBook(workload, seed=1).step(2), ScriptBook(workload, seed=1).step(2)
    assert first == again
    assert ScriptBook(workload, seed=2).step(2) != first
    limits = workload.limits
    for script in first:
        assert 2 <= len(script.turns) <= limits.max_turns
        assert script.turns[-1].tool is None and all(t.tool for t in script.turns[:-1])
        context = script.prompt_tokens + sum(t.output_tokens + t.output_chars for t in script.turns)
        assert context < limits.max_context_tokens
        assert script.solved == any(turn.passed for turn in script.turns)


def test_failing_checks_mean_longer_trajectories_with_a_heavy_tail() -> None:
    scripts = ScriptBook(load_workload("swe-agent")).step(2)
    lengths = sorted(s.output_tokens for s in scripts)
    assert lengths[-1] > 2 * lengths[len(lengths) // 2]  # the tail
    solved_first = [s.output_tokens for s in scripts if _failures(s) == 0]
    failed_twice = [s.output_tokens for s in scripts if _failures(s) >= 2]
    assert sum(failed_twice) / len(failed_twice) > 1.5 * sum(solved_first) / len(solved_first)


def _failures(script: TrajectoryScript) -> int:
    return sum(1 for turn in script.turns if turn.tool == "run_tests" and not turn.passed)


def test_turns_grow_with_the_drift_across_rl_steps(tmp_path: Path) -> None:
    exact = USER_WORKLOAD.replace("sigma = 0.6, min = 96", "sigma = 0.0, min = 96")
    workload = load_workload(str(write(tmp_path, exact)))
    early = draw_script(workload, 0, 123, 0).turns[0].output_tokens
    later = draw_script(workload, 4, 123, 0).turns[0].output_tokens
    assert early == 500 and later == round(500 * 1.05**4)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (("prompts = 24", "prompts = 24\nbatch = 3"), "rollout.batch: Extra inputs"),
        (("min = 96", "min = 10"), "turn.tokens.min must be at least 96"),
        (('name = "data-agent"', 'name = "Data Agent"'), "name: String should match"),
        (("max_turns = 10", "max_turns = 1"), "allow a tool turn and a final answer"),
        (("alpha = 1.0", "alpha = -1.0"), "solve_rate.alpha"),
        (("calls_first_attempt = [1, 2]", "calls_first_attempt = [2, 1]"), "call ranges"),
    ],
)
def test_invalid_workloads_are_refused_with_the_field_named(
    tmp_path: Path, change: tuple[str, str], message: str
) -> None:
    path = write(tmp_path, USER_WORKLOAD.replace(*change, 1))
    with pytest.raises(WorkloadError, match=message):
        load_workload(str(path))


def test_missing_files_and_names_and_broken_toml_are_explained(tmp_path: Path) -> None:
    with pytest.raises(WorkloadError, match="shipped: math-code, search-agent, swe-agent"):
        load_workload("no-such-workload")
    with pytest.raises(WorkloadError, match="no such file"):
        load_workload(str(tmp_path / "missing.toml"))
    with pytest.raises(WorkloadError, match="not valid TOML"):
        load_workload(str(write(tmp_path, "name = [")))


def test_the_reference_fleet_derives_each_instance_from_the_cost_model() -> None:
    fleet = load_fleet()
    assert [plan.tp for plan in fleet.instances] == [1, 1, 2, 4, 1, 1, 2, 4]
    assert fleet.gpus == 16
    kv = [fleet.kv_capacity_tokens(tp) for tp in (1, 2, 4)]
    assert 200_000 < kv[0] < kv[1] < kv[2]  # ~39 GB free on one A100 / 160 KiB per token
    tp1, tp4 = fleet.latency(1), fleet.latency(4)
    alone_tp1, alone_tp4 = tp1.step_time(1, 8000), tp4.step_time(1, 8000)
    assert 0.015 < alone_tp1 < 0.025 and 2.5 < alone_tp1 / alone_tp4 < 4
    spec = fleet.spec("m")
    assert [b.name for b in spec.buckets] == ["short", "medium", "long"]
    assert spec.instances[3].cost == fleet.step_cost(4) and spec.max_queue_length == 3


def test_an_invalid_fleet_is_refused(tmp_path: Path) -> None:
    text = (Path(str(_shipped_fleet())).read_text()).replace("tp = [4]", "tp = [8]")
    with pytest.raises(WorkloadError, match=r"no bucket takes instances of TP \[4\]"):
        load_fleet(str(write(tmp_path, text, "fleet.toml")))


def _shipped_fleet() -> Path:
    from libra.emulation.workloads import package_file

    return package_file("a100-qwen3-14b-2x4", folder="fleets")


def test_workload_objects_validate_without_a_file() -> None:
    data = {
        "name": "tiny",
        "rollout": {"prompts": 1, "samples_per_prompt": 1},
        "limits": {"max_turns": 2, "max_context_tokens": 1000},
        "prompt_tokens": {"median": 100},
        "solve_rate": {"alpha": 1, "beta": 1},
        "turn": {"tokens": {"median": 100, "min": 96}, "final_tokens": {"median": 5, "min": 1}},
        "check": {
            "name": "check",
            "latency_s": {"median": 1},
            "on_pass": {"chars": {"median": 10}},
            "on_fail": {"status": "failure", "chars": {"median": 10}},
        },
    }
    script = draw_script(Workload.model_validate(data), 0, 1, 0)
    assert len(script.turns) == 2 and script.turns[0].tool == "check"
