"""``libra bench docs``: the README's benchmark tables are what the saved runs say."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from libra.bench._docs import README, SAVED, TABLES, BenchDocsError, DocTable, rewrite, run

REPO = Path(__file__).resolve().parents[2]


def test_the_readme_tables_match_their_saved_runs() -> None:
    """A figure edited by hand (or a run saved without rewriting) fails here."""
    text = (REPO / README).read_text()
    assert rewrite(text, list(TABLES.values()), REPO / SAVED) == (text, [])
    saved = {path.stem for path in (REPO / SAVED).glob("*.json")}
    assert saved <= set(TABLES), "a saved run that no README region shows"
    for name in saved:
        assert f"<!-- bench:{name} -->" in text


def test_a_run_is_saved_with_its_command_and_written_between_the_markers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    table = DocTable("tiny-soak", ("bench", "soak", "--n", "40", "--json"), TABLES["soak"].render)
    saved = run(table)  # a real soak of 40 trajectories, in a process of its own
    assert saved["command"] == "libra bench soak --n 40 --json"
    assert saved["output"]["trajectories"] == 40 and saved["output"]["lost"] == 0
    assert json.loads(table.saved.read_text()) == saved
    readme = "intro\n<!-- bench:tiny-soak -->\nold figures\n<!-- /bench:tiny-soak -->\nafter\n"
    text, changed = rewrite(readme, [table], SAVED)
    assert changed == ["tiny-soak"]
    assert text.startswith("intro\n<!-- bench:tiny-soak -->\nWritten by `libra bench docs`")
    assert "```\n\nRSS at each tenth of the trajectories (MB): " in text
    assert text.endswith(".\n<!-- /bench:tiny-soak -->\nafter\n")
    assert '"lost": 0' in text and "old figures" not in text
    assert rewrite(text, [table], SAVED) == (text, [])


def test_a_saved_run_without_its_region_says_which_markers_to_add(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    SAVED.mkdir(parents=True)
    (SAVED / "soak.json").write_text(json.dumps({"command": "c", "cores": 2, "output": {}}))
    with pytest.raises(BenchDocsError, match="<!-- bench:soak -->"):
        rewrite("no markers here\n", [TABLES["soak"]], SAVED)


def test_check_fails_naming_a_region_out_of_date(tmp_path: Path) -> None:
    (tmp_path / "README.md").write_text(
        (REPO / README).read_text().replace("<!-- /bench:", "stale\n<!-- /bench:", 1)
    )
    (tmp_path / "docs").symlink_to(REPO / "docs")
    done = subprocess.run(
        [sys.executable, "-m", "libra", "bench", "docs", "--check"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 1
    assert "README tables out of date" in done.stderr
