"""Ended sessions as trajectory records: appended to a JSONL file (the format
``libra rollout`` writes) and offered to a bounded stream a trainer may read.

The stream never makes a client wait: when it holds ``buffer`` records nobody has read,
the oldest is dropped (and counted in :attr:`Recorder.dropped`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterator
from pathlib import Path
from typing import BinaryIO

import anyio
import msgspec

from libra.engine import TrajectoryRecord


class Recorder:
    def __init__(self, path: Path | None, *, stream: bool, buffer: int) -> None:
        self.path, self.stream = path, stream
        self.dropped = 0  # records the stream lost to a reader that did not keep up
        self.written = 0
        self._buffer: deque[TrajectoryRecord] = deque(maxlen=buffer)
        self._file: BinaryIO | None = None
        self._encoder = msgspec.json.Encoder()
        self._arrived = anyio.Event()
        self._closed = False

    @property
    def on(self) -> bool:
        return self.path is not None or self.stream

    def open(self) -> None:
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("ab")

    def close(self) -> None:
        """No more records: the file is closed, the stream ends once read."""
        if self._file is not None:
            self._file.close()
            self._file = None
        self._closed = True
        self._arrived.set()

    def add(self, record: TrajectoryRecord) -> None:
        if self._file is not None:
            # One write of a whole line, flushed: a reader never sees half a record.
            self._file.write(self._encoder.encode(record) + b"\n")
            self._file.flush()
            self.written += 1
        if self.stream:
            if len(self._buffer) == self._buffer.maxlen:
                self.dropped += 1
            self._buffer.append(record)  # past maxlen, the deque drops the oldest
            self._arrived.set()

    async def records(self) -> AsyncIterator[TrajectoryRecord]:
        """Records as sessions end, until :meth:`close` (read from one task)."""
        while True:
            while self._buffer:
                yield self._buffer.popleft()
            if self._closed:
                return
            self._arrived = anyio.Event()
            await self._arrived.wait()
