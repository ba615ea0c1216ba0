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
    """Finds a record in the files ``files()`` lists (read when asked, and read again
    when an id is missing: a live run's files grow)."""

    def __init__(self, files: Callable[[], list[Path]]) -> None:
        self.files = files
        self._by_id: dict[str, bytes] = {}

    def __call__(self, trajectory_id: str) -> bytes | None:
        if trajectory_id not in self._by_id:
            self._read()
        return self._by_id.get(trajectory_id)

    def _read(self) -> None:
        for file in self.files():
            with file.open("rb") as lines:
                for line in lines:
                    try:
                        self._by_id[record_id(line)] = line.rstrip(b"\n")
                    except msgspec.DecodeError:
                        continue  # a line cut by a crash, or being written
