"""Ended trajectories' records, found by id in a run's record files (JSONL): what the
view shows a conversation from."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import msgspec


class _Id(msgspec.Struct, forbid_unknown_fields=False):
    id: str


_decoder = msgspec.json.Decoder(_Id)


def record_id(line: bytes) -> str:
    """The id of a record's JSON line."""
    return _decoder.decode(line).id


class RecordFiles:
    """Finds a record in the files ``files()`` lists. A live run's files grow, so a
    missing id has each file read on from where the last read stopped (from the start
    again if it got shorter: rewritten), complete lines only."""

    def __init__(self, files: Callable[[], list[Path]]) -> None:
        self.files = files
        self._by_id: dict[str, bytes] = {}
        self._read_to: dict[Path, int] = {}

    def __call__(self, trajectory_id: str) -> bytes | None:
        if trajectory_id not in self._by_id:
            for file in self.files():
                self._read_on(file)
        return self._by_id.get(trajectory_id)

    def _read_on(self, file: Path) -> None:
        start = self._read_to.get(file, 0)
        if file.stat().st_size < start:
            start = 0
        with file.open("rb") as lines:
            lines.seek(start)
            for line in lines:
                if not line.endswith(b"\n"):
                    break  # being written: read it next time
                start += len(line)
                try:
                    self._by_id[record_id(line)] = line.rstrip(b"\n")
                except msgspec.DecodeError:
                    continue  # a line cut by a crash
        self._read_to[file] = start
