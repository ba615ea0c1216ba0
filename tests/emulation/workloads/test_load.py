"""Loading workloads: the shipped ones, a user's own, and errors that explain themselves."""

from __future__ import annotations

from pathlib import Path

import pytest

from libra.emulation.workloads import (
    EnvClasses,
    Mix,
    ScriptBook,
    WorkloadError,
    WorkloadScript,
    available_workloads,
    book_of,
    load_step,
    load_workload,
)
from libra.emulation.workloads._env import prompt_text
from tests._helpers import USER_WORKLOAD, write


def test_the_shipped_workloads_load_and_cite_their_sources() -> None:
    assert {"swe-agent", "search-agent", "math-code", "web-research"} <= set(available_workloads())
    for name in available_workloads():
        workload = load_step(name)
        assert workload.name == name
        parts = workload.parts if isinstance(workload, Mix) else (workload,)
        assert all(part.sources and part.description for part in parts)


def test_a_workload_written_from_the_documentation_loads_and_plays(tmp_path: Path) -> None:
    workload = load_workload(str(write(tmp_path, USER_WORKLOAD)))
    assert workload.name == "data-agent" and workload.tool_names == ["describe_table", "run_sql"]
    scripts = ScriptBook(workload).step(1)
    assert len(scripts) == 96
    assert {turn.tool for s in scripts for turn in s.turns} == {"describe_table", "run_sql", None}
    assert any(turn.status == "failure" for s in scripts for turn in s.turns)


def test_missing_files_and_names_and_broken_toml_are_explained(tmp_path: Path) -> None:
    shipped = (
        "math-code, search-agent, search-swe-mix, swe-agent, swe-drift, swe-memoryless, swe-shift"
    )
    with pytest.raises(WorkloadError, match=f"shipped: {shipped}"):
        load_workload("no-such-workload")
    with pytest.raises(WorkloadError, match="no such file"):
        load_workload(str(tmp_path / "missing.toml"))
    with pytest.raises(WorkloadError, match="not valid TOML"):
        load_workload(str(write(tmp_path, "name = [")))


def test_a_mixed_step_draws_each_part_from_its_own_workload(tmp_path: Path) -> None:
    write(tmp_path, USER_WORKLOAD, "data-agent.toml")
    mix_file = tmp_path / "mix.toml"
    mix_file.write_text(
        'name = "mixed"\nhistory_steps = 1\n'
        '[[mix]]\nworkload = "data-agent.toml"\nprompts = 2\n'  # beside the mixture
        '[[mix]]\nworkload = "search-agent"\nprompts = 3\n'  # a shipped one
    )
    mix = load_step(str(mix_file))
    assert isinstance(mix, Mix) and [p.name for p in mix.parts] == ["data-agent", "search-agent"]
    data, search = mix.parts
    assert (data.rollout.prompts, search.rollout.prompts, mix.history_steps) == (2, 3, 1)
    assert mix.limits.max_turns == max(data.limits.max_turns, search.limits.max_turns)
    book = book_of(mix)
    scripts = book.step(1)
    # Each part's own samples per prompt, scripts and tool timeout, named by its env.
    samples = data.rollout.samples_per_prompt, search.rollout.samples_per_prompt
    assert [s.workload for s in scripts] == ["data-agent"] * 2 * samples[0] + [
        "search-agent"
    ] * 3 * samples[1]
    assert scripts[-1] == ScriptBook(search).script(1, scripts[-1].task_seed, scripts[-1].sample)
    assert {s.tool_timeout_s for s in scripts} == {
        data.limits.tool_timeout_s,
        search.limits.tool_timeout_s,
    }
    # The model and the envs play each trajectory's own workload.
    classes = EnvClasses(book)
    for script in (scripts[0], scripts[-1]):
        env = classes(1, script.sample, script.workload)()
        assert env.name == script.workload and env.reset(script.task_seed) == prompt_text(script)
        assert env.max_turns == mix.parts[script.workload == "search-agent"].limits.max_turns
    model = WorkloadScript(book)
    assert model.book.script(1, scripts[0].task_seed, 0, "data-agent") == scripts[0]
    with pytest.raises(WorkloadError, match="a mixture of workloads"):
        load_workload(str(mix_file))
    with pytest.raises(WorkloadError, match="mix: List should have at least 2 items"):
        mix_file.write_text('name = "one"\n[[mix]]\nworkload = "swe-agent"\nprompts = 1\n')
        load_step(str(mix_file))
