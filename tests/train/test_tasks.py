"""Each step's tasks: a mixture of envs by weight, seeded tasks as the loop always drew
them, a task file's in epochs; the same for a step whenever it is asked (a resume)."""

from __future__ import annotations

from collections import Counter

import pytest

from libra.engine import jobs_for
from libra.envs import Task, TaskId
from libra.train import StepTasks, TaskShare


def listed(env: str, n: int) -> list[Task]:
    return [Task(TaskId(env, f"t{i}"), i, {"i": i}) for i in range(n)]


def test_one_seeded_env_draws_what_each_step_drew_from_seed_plus_step() -> None:
    tasks = StepTasks([TaskShare("calc")], per_step=3, seed=5)
    for step in range(4):
        drawn = jobs_for(None, "calc", 3 * 2, samples_per_prompt=2, seed=5 + step, step=step)
        assert tasks.of_step(step) == [job.task for job in drawn[::2]]


def test_a_task_file_plays_each_task_as_often_and_never_twice_in_a_step() -> None:
    tasks = StepTasks([TaskShare("quiz", listed=listed("quiz", 7))], per_step=3, seed=1)
    steps = [tasks.of_step(step) for step in range(70)]
    for played in steps:
        assert len(played) == 3 and len({t.id for t in played}) == 3
    counts = Counter(t.id.key for played in steps for t in played)
    assert set(counts) == {f"t{i}" for i in range(7)}
    assert max(counts.values()) - min(counts.values()) <= 2  # epochs: all, then all again
    # Each epoch in an order of its own.
    assert [t.id.key for t in steps[0]] != [t.id.key for t in steps[7]]


def test_a_mixture_draws_its_envs_by_weight() -> None:
    shares = [TaskShare("arith", weight=3), TaskShare("quiz", listed=listed("quiz", 5))]
    tasks = StepTasks(shares, per_step=4, seed=0)
    envs = Counter(t.id.env for step in range(500) for t in tasks.of_step(step))
    assert envs["arith"] / 2000 == pytest.approx(0.75, abs=0.03)
    assert envs["quiz"] / 2000 == pytest.approx(0.25, abs=0.03)


def test_a_step_s_tasks_follow_from_the_seed_and_the_step_alone() -> None:
    def mixture() -> StepTasks:
        shares = [TaskShare("arith", 2), TaskShare("quiz", 1, listed("quiz", 4))]
        return StepTasks(shares, per_step=4, seed=3)

    walked = mixture()
    in_order = [walked.of_step(step) for step in range(12)]
    resumed = mixture()  # a resume asks for step 7 first, then goes on
    assert [resumed.of_step(step) for step in (7, 8, 9)] == in_order[7:10]
    assert walked.of_step(2) == in_order[2]  # and asked again, the same


def test_a_file_too_short_for_a_step_is_refused() -> None:
    with pytest.raises(ValueError, match="lists 2 tasks, fewer than the 3"):
        StepTasks([TaskShare("quiz", listed=listed("quiz", 2))], per_step=3)
