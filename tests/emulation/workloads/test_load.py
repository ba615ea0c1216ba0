"""Loading workloads: the shipped ones, a user's own, and errors that explain themselves."""

from __future__ import annotations

from pathlib import Path

import pytest

from libra.emulation.workloads import (
    ScriptBook,
    WorkloadError,
    available_workloads,
    load_workload,
)
from tests._helpers import USER_WORKLOAD, write


def test_the_shipped_workloads_load_and_cite_their_sources() -> None:
    assert {"swe-agent", "search-agent", "math-code", "web-research"} <= set(available_workloads())
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


def test_missing_files_and_names_and_broken_toml_are_explained(tmp_path: Path) -> None:
    shipped = "math-code, search-agent, swe-agent, swe-drift, swe-memoryless, web-research"
    with pytest.raises(WorkloadError, match=f"shipped: {shipped}"):
        load_workload("no-such-workload")
    with pytest.raises(WorkloadError, match="no such file"):
        load_workload(str(tmp_path / "missing.toml"))
    with pytest.raises(WorkloadError, match="not valid TOML"):
        load_workload(str(write(tmp_path, "name = [")))
