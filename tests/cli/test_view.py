"""``libra view PATH``: a run folder's events log and record files, or a rollout's
``FILE.events.jsonl`` beside ``FILE.jsonl``; a path with no log is one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from libra.cli import main
from libra.cli._view import sources


def test_a_run_folder_and_a_rollout_s_log_find_their_records(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "rollouts").mkdir(parents=True)
    (run / "eval").mkdir()
    for path in ("events.jsonl", "rollouts/step-0.jsonl", "eval/step-0.jsonl"):
        (run / path).write_text("")
    assert sources(run) == (
        run / "events.jsonl",
        [run / "rollouts/step-0.jsonl", run / "eval/step-0.jsonl"],
    )
    (tmp_path / "calc.jsonl").write_text("")
    (tmp_path / "calc.events.jsonl").write_text("")
    assert sources(tmp_path / "calc.events.jsonl") == (
        tmp_path / "calc.events.jsonl",
        [tmp_path / "calc.jsonl"],
    )


def test_no_events_log_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["view", str(tmp_path)]) == 2
    assert capsys.readouterr().err == (
        f"libra: error: {tmp_path / 'events.jsonl'} does not exist: no events log to view\n"
    )
