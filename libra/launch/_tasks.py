"""Task files: the tasks of a dataset, one JSON object a line.

Each line of a ``.jsonl`` file is one task::

    {"key": "gsm8k-17", "seed": 17, "payload": {"question": "...", "answer": "42"}}

All three fields are optional. ``key`` (a string or an integer) names the task within
its env and must be unique in the file; it defaults to the line's index among the
tasks (0, 1, ...), which is also ``seed``'s default. ``payload`` is any JSON object,
handed to envs whose ``reset`` takes the :class:`~libra.envs.Task`. Blank lines are
skipped; any other field is an error (a typo would otherwise vanish silently).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

from libra.config import ConfigError
from libra.envs import Task, TaskId


class _Line(msgspec.Struct, forbid_unknown_fields=True):
    key: str | int | None = None
    seed: int | None = None
    payload: dict[str, Any] | None = None


def read_tasks(path: Path, env: str) -> list[Task]:
    """The tasks of env ``env`` listed in the JSONL file ``path``, in order."""
    decoder = msgspec.json.Decoder(_Line)
    tasks: list[Task] = []
    keys: set[str] = set()
    with path.open("rb") as lines:
        for number, raw in enumerate(lines, 1):
            if not raw.strip():
                continue
            try:
                line = decoder.decode(raw)
            except msgspec.DecodeError as exc:
                raise ConfigError(f"tasks {path}, line {number}: {exc}") from None
            index = len(tasks)
            key = str(index if line.key is None else line.key)
            if key in keys:
                raise ConfigError(f"tasks {path}, line {number}: key {key!r} appears twice")
            keys.add(key)
            seed = index if line.seed is None else line.seed
            tasks.append(Task(TaskId(env, key), seed, line.payload))
    if not tasks:
        raise ConfigError(f"tasks {path} lists no task")
    return tasks
