"""Which tasks each step plays: a mixture of envs, each with seeded tasks or a task
file's.

A step's ``prompts_per_step`` tasks follow from the run's seed and the step alone, so
a resumed run plays the tasks the interrupted one would have (the step is the data
position):

- **the mixture**: with more than one env, step ``k`` draws each prompt's env by weight
  with ``random.Random(seed + k)`` (a run of one env draws nothing);
- **seeded** tasks (an env without a task file): the same generator then draws each
  task's seed, env by env, in the mixture's order;
- **listed** tasks (a task file): the env's tasks as a stream of epochs, each epoch
  shuffled anew (seeded by the run's seed, the env's place in the mixture and the
  epoch); a step takes the next ones its draw gave the env, passing over any it took
  already in that step (at an epoch's seam), so no task plays twice in one step. A
  file must hold ``prompts_per_step`` tasks at least.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from libra.envs import Task


@dataclass(frozen=True)
class TaskShare:
    """One env of the mixture: its name, its weight, and its listed tasks (None:
    seeded ones)."""

    env_name: str
    weight: float = 1.0
    listed: Sequence[Task] | None = None


class StepTasks:
    """The tasks of each step (see the module)."""

    def __init__(self, shares: Sequence[TaskShare], per_step: int, seed: int = 0) -> None:
        if not shares:
            raise ValueError("a mixture of no env")
        for share in shares:
            if share.listed is not None and len(share.listed) < per_step:
                raise ValueError(
                    f"env {share.env_name}'s task file lists {len(share.listed)} tasks, "
                    f"fewer than the {per_step} a step plays (prompts_per_step)"
                )
        self.shares, self.per_step, self.seed = list(shares), per_step, seed
        self._next_step = 0
        self._taken = [0] * len(self.shares)  # of each listed stream, before _next_step
        self._epochs: dict[tuple[int, int], list[Task]] = {}

    def of_step(self, step: int) -> list[Task]:
        if step < self._next_step:  # asked again, or back (a resume): replay from 0
            self._next_step, self._taken = 0, [0] * len(self.shares)
        while self._next_step < step:
            self._draw(self._next_step)
        return self._draw(step)

    def _draw(self, step: int) -> list[Task]:
        """Step ``step``'s tasks; the listed streams move past what it took."""
        rng = random.Random(self.seed + step)
        counts = Counter({0: self.per_step})
        if len(self.shares) > 1:
            weights = [share.weight for share in self.shares]
            counts = Counter(rng.choices(range(len(self.shares)), weights, k=self.per_step))
        tasks: list[Task] = []
        for index, share in enumerate(self.shares):
            count = counts[index]
            if share.listed is None:
                tasks += [
                    Task.from_seed(share.env_name, rng.randrange(2**31)) for _ in range(count)
                ]
            else:
                tasks += self._listed(index, count)
        self._next_step = step + 1
        return tasks

    def _listed(self, index: int, count: int) -> list[Task]:
        """The next ``count`` distinct tasks of listed stream ``index``."""
        taken: dict[str, Task] = {}
        while len(taken) < count:
            epoch, at = divmod(self._taken[index], len(self.shares[index].listed or ()))
            task = self._epoch(index, epoch)[at]
            taken.setdefault(str(task.id), task)
            self._taken[index] += 1
        return list(taken.values())

    def _epoch(self, index: int, epoch: int) -> list[Task]:
        key = (index, epoch)
        if key not in self._epochs:
            stale = [k for k in self._epochs if k[0] == index and k[1] < epoch - 1]
            for k in stale:  # a run moves forward: the last two epochs of each are enough
                del self._epochs[k]
            order = list(self.shares[index].listed or ())
            random.Random(f"{self.seed}:{index}:{epoch}").shuffle(order)
            self._epochs[key] = order
        return self._epochs[key]
