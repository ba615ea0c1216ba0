"""Which tasks each step plays: seeded ones, or a task file's, in epochs.

A step's tasks follow from the run's seed and the step alone, so a resumed run plays
the tasks the interrupted one would have (the step is the data position):

- **seeded** (no ``rollout.tasks``): step ``k`` draws ``prompts_per_step`` task seeds
  with ``seed + k``;
- **listed** (``rollout.tasks``): the file's tasks in epochs, each epoch a shuffle
  seeded by ``seed + epoch``, ``prompts_per_step`` tasks a step. An epoch's last tasks
  that would not fill a step are left for the next shuffle (a data loader's
  ``drop_last``), so no task plays twice in one step.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from libra.envs import Task


@dataclass(frozen=True)
class StepTasks:
    """The tasks of each step (see the module): ``listed`` ones, or seeded tasks of
    env ``env_name``."""

    env_name: str
    per_step: int
    seed: int = 0
    listed: Sequence[Task] | None = None
    _epochs: dict[int, list[Task]] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.listed is not None and len(self.listed) < self.per_step:
            raise ValueError(
                f"the task file lists {len(self.listed)} tasks, fewer than the "
                f"{self.per_step} a step plays (prompts_per_step)"
            )

    @property
    def steps_per_epoch(self) -> int | None:
        """Steps that play the listed tasks once (None: seeded tasks never run out)."""
        return None if self.listed is None else len(self.listed) // self.per_step

    def of_step(self, step: int) -> list[Task]:
        if self.listed is None:
            rng = random.Random(self.seed + step)
            return [
                Task.from_seed(self.env_name, rng.randrange(2**31)) for _ in range(self.per_step)
            ]
        epoch, slot = divmod(step, self.steps_per_epoch or 1)
        start = slot * self.per_step
        return self._shuffled(epoch)[start : start + self.per_step]

    def _shuffled(self, epoch: int) -> list[Task]:
        if epoch not in self._epochs:
            self._epochs.clear()  # a run moves forward: one epoch's order is enough
            order = list(self.listed or ())
            random.Random(self.seed + epoch).shuffle(order)
            self._epochs[epoch] = order
        return self._epochs[epoch]
