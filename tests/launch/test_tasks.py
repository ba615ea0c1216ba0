"""Task files: one JSON object a line, with defaults, and one clear error per mistake."""

from __future__ import annotations

from pathlib import Path

import pytest

from libra.config import ConfigError
from libra.envs import TaskId
from libra.launch import read_tasks


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "tasks.jsonl"
    path.write_text(text)
    return path


def test_keys_and_seeds_default_to_the_index_and_payloads_come_through(tmp_path: Path) -> None:
    text = '{"key": "q-1", "seed": 9, "payload": {"question": "2+2?"}}\n\n{"key": 7}\n{}\n'
    tasks = read_tasks(write(tmp_path, text), "quiz")
    assert [t.id for t in tasks] == [
        TaskId("quiz", "q-1"),
        TaskId("quiz", "7"),
        TaskId("quiz", "2"),
    ]
    assert [t.seed for t in tasks] == [9, 1, 2]
    assert [t.payload for t in tasks] == [{"question": "2+2?"}, None, None]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"key": "a"}\n{"key": "a"}\n', "line 2: key 'a' appears twice"),
        ('{"key": "a", "sede": 1}\n', "line 1: Object contains unknown field `sede`"),
        ('{"seed": "one"}\n', "line 1: Expected `int | null`, got `str`"),
        ("not json\n", "line 1: JSON is malformed"),
        ("\n\n", "lists no task"),
    ],
)
def test_a_mistake_names_its_line(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=r"^tasks ") as raised:
        read_tasks(write(tmp_path, text), "quiz")
    assert message in str(raised.value)
