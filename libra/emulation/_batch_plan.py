"""What the batching engine plans with: one request inside it (:class:`Sequence`) and a run
of decode steps over an unchanged batch, planned ahead in closed form (:class:`Segment`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import anyio

SequenceState = Literal["waiting", "running", "done", "aborted", "stopped"]
"""``aborted``: its caller went away; ``stopped``: a pause in abort mode ended it early."""


@dataclass(eq=False, slots=True)
class Sequence:
    """One request inside the engine."""

    prompt_tokens: int
    new_tokens: int
    priority: int
    arrival: int
    prefill_tokens: int = 0  # prompt tokens not found in the prefix cache
    state: SequenceState = "waiting"
    produced: int = 0
    joins_at: float = math.inf  # when prefill ends; the sequence joins the next step after
    is_driver: bool = False
    # Set once: when the sequence is done, or when it is handed the driver role.
    wakeup: anyio.Event = field(default_factory=anyio.Event)

    @property
    def kv_reservation(self) -> int:
        return self.prompt_tokens + self.new_tokens

    @property
    def context_tokens(self) -> int:
        return self.prompt_tokens + self.produced

    @property
    def remaining(self) -> int:
        return self.new_tokens - self.produced


@dataclass(eq=False, slots=True)
class Segment:
    """A run of decode steps over one unchanged batch, planned ahead in closed form.

    Every step gives each sequence one token, so the batch's context grows by ``B``
    tokens a step and each step is ``growth`` seconds longer than the one before: step
    ``k`` (counted from 1) ends at ``start + k * first + k * (k - 1) / 2 * growth``. The
    driver sleeps once to the end of the run instead of once per token; the run is cut
    short (never below the step in flight) when the batch must change earlier.
    """

    start: float
    batch: list[Sequence]
    first: float  # seconds of the first step
    growth: float  # seconds each step adds to the one before
    target: int  # steps in the run; the batch is re-planned after the last
    credited: int = 0  # steps already added to the sequences' ``produced``

    def end_of(self, step: int) -> float:
        return self.start + step * self.first + step * (step - 1) / 2 * self.growth

    @property
    def end(self) -> float:
        return self.end_of(self.target)

    def steps_done_by(self, now: float) -> int:
        """Steps of the run that have ended by ``now`` (at most ``target``)."""
        if now >= self.end:
            return self.target
        elapsed = now - self.start
        if elapsed <= 0:
            return 0
        if self.growth > 0:  # solve growth/2 k^2 + (first - growth/2) k = elapsed for k
            b = self.first - self.growth / 2
            guess = (-b + math.sqrt(b * b + 2 * self.growth * elapsed)) / self.growth
        else:
            guess = elapsed / self.first
        steps = min(self.target, max(0, int(guess)))
        while steps < self.target and self.end_of(steps + 1) <= now:  # undo rounding errors
            steps += 1
        while steps > 0 and self.end_of(steps) > now:
            steps -= 1
        return steps

    def first_end_at_or_after(self, moment: float) -> int:
        """The first step whose end is at or after ``moment`` (at most ``target``)."""
        steps = self.steps_done_by(moment)
        if steps < self.target and self.end_of(steps) < moment:
            steps += 1
        return max(1, steps)
