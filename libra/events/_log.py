"""The events log: a run's events, one JSON line each, written as they come (in batches),
so that ``libra view RUN_DIR`` shows a finished run as the live view showed it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import msgspec

from libra.events._bus import Subscription
from libra.events._events import AnyEvent, Event

EVENTS_FILE = "events.jsonl"
_FLUSH_S = 0.5  # what a crash may lose of the log

_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(AnyEvent)


def encode(event: Event) -> bytes:
    return _encoder.encode(event)


async def write_log(subscription: Subscription, path: Path) -> None:
    """Append every event of ``subscription`` to ``path`` until it closes."""
    with path.open("ab") as out:
        async for batch in subscription.batches(_FLUSH_S):
            out.write(b"".join(_encoder.encode(event) + b"\n" for event in batch))
            out.flush()


def read_events(path: Path) -> Iterator[AnyEvent]:
    """The events of a log, in order (a line cut by a crash is skipped)."""
    with path.open("rb") as lines:
        for line in lines:
            try:
                yield _decoder.decode(line)
            except msgspec.DecodeError:
                continue
