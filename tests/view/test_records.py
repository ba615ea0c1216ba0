"""Records found by id in a run's growing files: read on from where the last read
stopped, a line being written left for later, a rewritten file read again."""

from __future__ import annotations

from pathlib import Path

from libra.view import RecordFiles


def test_a_growing_file_is_read_on_and_a_rewritten_one_again(tmp_path: Path) -> None:
    file = tmp_path / "rollout.jsonl"
    file.write_bytes(b'{"id":"a","reward":1}\n')
    found = RecordFiles(lambda: [file])
    assert found("a") == b'{"id":"a","reward":1}'
    assert found("b") is None
    with file.open("ab") as out:
        out.write(b'{"id":"b"}\n{"id":"c","rew')  # c is being written
    assert found("b") == b'{"id":"b"}'
    assert found("c") is None
    with file.open("ab") as out:
        out.write(b'ard":0}\n')
    assert found("c") == b'{"id":"c","reward":0}'
    file.write_bytes(b'{"id":"d"}\n')  # rewritten, shorter
    assert found("d") == b'{"id":"d"}'
