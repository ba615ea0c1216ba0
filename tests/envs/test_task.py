"""Typed task ids, and ``reset`` taking a seed or the whole task."""

from __future__ import annotations

from typing import Any

import pytest

from libra.envs import Env, GroupId, Task, TaskId, TrajectoryId


def test_ids_render_once_and_compare_by_their_fields() -> None:
    task = TaskId("calc", "17")
    trajectory = TrajectoryId(2, task, 3)
    assert (str(task), str(trajectory), str(trajectory.group)) == (
        "calc/17",
        "calc/17#3@2",
        "calc/17@2",
    )
    assert trajectory.group == GroupId(2, task)
    assert trajectory != TrajectoryId(3, task, 3)  # the same sample at another step
    assert Task.from_seed("calc", 17) == Task(task, 17)
    assert len({Task(task, 17, {"row": 1}), Task(task, 17, {"row": 1})}) == 1
    assert {trajectory: 1}[TrajectoryId(2, TaskId("calc", "17"), 3)] == 1


class BySeed(Env):
    def reset(self, seed: int) -> str:
        return f"seed {seed}"

    def reward(self, answer: str) -> float:
        return 0.0


class ByTask(Env):
    def reset(self, task: Task) -> str:
        assert task.payload is not None
        return f"row {task.payload['row']}"

    def reward(self, answer: str) -> float:
        return 0.0


class ByUnannotatedTask(Env):
    def reset(self, task):  # type: ignore[no-untyped-def]
        return f"key {task.id.key}"

    def reward(self, answer: str) -> float:
        return 0.0


class ByAnything(Env):
    def reset(self, value: Any) -> str:
        return f"value {value}"

    def reward(self, answer: str) -> float:
        return 0.0


@pytest.mark.parametrize(
    ("env", "prompt"),
    [(BySeed, "seed 5"), (ByTask, "row 3"), (ByUnannotatedTask, "key k"), (ByAnything, "value 5")],
)
def test_reset_gets_what_its_signature_asks_for(env: type[Env], prompt: str) -> None:
    task = Task(TaskId("x", "k"), 5, {"row": 3})
    assert env().reset_with(task) == prompt
