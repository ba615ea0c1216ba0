"""Each step's tasks: seeded ones as the loop always drew them, a task file's in epochs."""

from __future__ import annotations

from collections import Counter

import pytest

from libra.engine import jobs_for
from libra.envs import Task, TaskId
from libra.train import StepTasks


def test_seeded_tasks_are_those_each_step_drew_from_seed_plus_step() -> None:
    tasks = StepTasks("calc", per_step=3, seed=5)
    for step in range(4):
        drawn = jobs_for(None, "calc", 3 * 2, samples_per_prompt=2, seed=5 + step, step=step)
        assert tasks.of_step(step) == [job.task for job in drawn[::2]]
    assert tasks.steps_per_epoch is None


def test_listed_tasks_play_once_an_epoch_in_a_new_order_each() -> None:
    listed = [Task(TaskId("quiz", str(i)), i, {"q": i}) for i in range(7)]
    tasks = StepTasks("quiz", per_step=3, seed=1, listed=listed)
    assert tasks.steps_per_epoch == 2  # 7 // 3: one task left over each epoch
    epochs = [[t for step in (2 * e, 2 * e + 1) for t in tasks.of_step(step)] for e in range(3)]
    for played in epochs:
        assert len(played) == 6 and len(set(map(id, played))) == 6  # none twice in an epoch
    assert len({tuple(t.id.key for t in played) for played in epochs}) == 3  # reshuffled
    # Over many epochs, every task plays about as often: the one left over changes.
    counts = Counter(t.id.key for step in range(60) for t in tasks.of_step(step))
    assert set(counts) == {str(i) for i in range(7)} and min(counts.values()) >= 15
    # A step's tasks follow from the seed and the step alone (a resume plays the same).
    again = StepTasks("quiz", per_step=3, seed=1, listed=listed)
    assert [again.of_step(step) for step in (5, 0, 3)] == [tasks.of_step(s) for s in (5, 0, 3)]


def test_a_file_too_short_for_a_step_is_refused() -> None:
    with pytest.raises(ValueError, match="lists 2 tasks, fewer than the 3"):
        StepTasks("quiz", per_step=3, listed=[Task.from_seed("quiz", i) for i in range(2)])
