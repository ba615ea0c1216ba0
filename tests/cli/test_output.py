"""Output paths are checked before a command starts anything, and their folders made."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from libra.cli import main
from libra.cli._output import check_output_file
from libra.config import UsageError


def test_a_folder_or_a_path_under_a_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match=f"--out {tmp_path} is a folder; give a file in it"):
        check_output_file(tmp_path, "--out")
    (tmp_path / "file").write_text("")
    with pytest.raises(UsageError, match="file is a file, not a folder"):
        check_output_file(tmp_path / "file" / "deeper" / "out.jsonl", "--out")


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_a_folder_it_may_not_write_to_is_refused(tmp_path: Path) -> None:
    tmp_path.chmod(0o500)
    try:
        with pytest.raises(UsageError, match="no permission to write in"):
            check_output_file(tmp_path / "new" / "out.jsonl", "--out")
    finally:
        tmp_path.chmod(0o700)


def test_missing_folders_are_fine_and_checking_makes_none(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "out.jsonl"
    check_output_file(path, "--out")
    assert not (tmp_path / "a").exists()  # checking writes nothing


def test_rollout_refuses_a_folder_before_it_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["rollout", "--env", "guess", "-n", "2", "--no-progress", "--out", str(tmp_path)])
    assert code == 2
    captured = capsys.readouterr()
    folder = f"--out {tmp_path} is a folder; give a file in it, e.g. {tmp_path / 'out'}"
    assert captured.err == f"libra: error: {folder}\n"
    assert captured.out == "" and list(tmp_path.iterdir()) == []


def test_rollout_makes_the_folders_of_its_output(tmp_path: Path) -> None:
    out = tmp_path / "runs" / "today" / "guess.jsonl"
    assert main(["rollout", "--env", "guess", "-n", "2", "--no-progress", "--out", str(out)]) == 0
    assert len(out.read_bytes().splitlines()) == 2
