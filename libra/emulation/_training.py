"""An emulated FSDP trainer: what an optimizer step and a worker's join really cost.

The allocation benchmark grades a planner that prices training with a datasheet prior and
fits it from step timings (``libra.alloc``). Its truth lives here, with knobs the planner
cannot read: achieved MFU, collective bandwidth and a per-worker latency that grows with
the ring, a per-step overhead, and lognormal jitter on every step. Joining costs are real
too: fetching the parameters and optimizer shards over the link, one zero-gradient sync.

Time passes by ``anyio.sleep``: under a virtual clock (trio's ``MockClock``) a benchmark
runs many steps in seconds; on a real clock the trainer is as slow as it claims.
"""

from __future__ import annotations

import math
import random

import anyio
from pydantic import Field, NonNegativeFloat, PositiveFloat

from libra.config import Section
from libra.fleet import Gpu, Model


class TrainTruth(Section):
    """How the emulated trainer really performs (defaults: a plausible A100 FSDP run, off
    from the planner's prior by tens of percent on purpose)."""

    mfu: float = Field(0.32, gt=0, le=1, description="achieved fraction of dense bf16 peak")
    link_bytes_per_s: PositiveFloat = Field(
        60e9, description="bytes per second a worker moves in FSDP collectives"
    )
    ring_latency_s: NonNegativeFloat = Field(
        0.05, description="seconds each collective adds per worker in the group"
    )
    overhead_s: NonNegativeFloat = Field(3.0, description="optimizer, logging, barriers")
    jitter: NonNegativeFloat = Field(0.05, description="lognormal sigma of each step's time")
    state_bytes_per_param: PositiveFloat = Field(
        12.0, description="optimizer and master-weight bytes a joiner fetches per parameter"
    )
    zero_sync_s: NonNegativeFloat = Field(1.0, description="one zero-gradient exchange")
    activate_s: NonNegativeFloat = Field(0.5, description="rebuilding the batch split")


class TrainJoinFailed(RuntimeError):
    """The emulated cluster was told this join fails (a fault a benchmark injects)."""


class EmulatedTrainer:
    """The training side of an emulated cluster: which workers train, and how long a step
    on them takes. Seeded: the same calls in the same order take the same times."""

    def __init__(
        self, gpu: Gpu, model: Model, truth: TrainTruth | None = None, *, seed: int = 0
    ) -> None:
        self.gpu, self.model = gpu, model
        self.truth = truth or TrainTruth()
        self.active: set[int] = set()
        self.failing: set[int] = set()  # workers whose next join fails mid-fetch
        self._rng = random.Random(seed)
        self._changed: anyio.Event | None = None  # set when the active set changes

    def step_seconds(self, tokens: int, workers: int) -> float:
        """One optimizer step over ``tokens`` on ``workers`` (no sleep: the formula)."""
        return self.formula_s(tokens, workers) * self._noise()

    def _noise(self) -> float:
        jitter = self.truth.jitter
        return math.exp(self._rng.gauss(0.0, jitter)) if jitter else 1.0

    def formula_s(self, tokens: int, workers: int) -> float:
        """What the truth says one step takes, without its jitter."""
        truth, params = self.truth, self.model.parameters
        compute = 6 * params * tokens / (workers * self.gpu.dense_bf16_flops * truth.mfu)
        # All-gather in forward and backward, reduce-scatter of gradients, bf16.
        moved = 3 * 2 * params * (workers - 1) / workers
        comm = moved / truth.link_bytes_per_s + 3 * truth.ring_latency_s * (workers - 1)
        return compute + comm + truth.overhead_s

    async def step(self, tokens: int) -> float:
        """Train one optimizer step on the active workers; return the seconds it took.

        A worker that joins or leaves mid-step takes or gives up its share of what is
        left (the batch is re-split at the next micro-batch, whose granularity is
        ignored): the rest of the step runs at the new set's pace."""
        if not self.active:
            raise RuntimeError("no worker is training")
        noise, done, started = self._noise(), 0.0, anyio.current_time()
        while done < 1.0:
            if not self.active:  # everyone left: nothing trains until someone joins
                await self._next_change()
                continue
            full = self.formula_s(tokens, len(self.active)) * noise
            begun = anyio.current_time()
            with anyio.move_on_after((1.0 - done) * full):
                await self._next_change()
            done = min(1.0, done + (anyio.current_time() - begun) / full)
            if done >= 1.0 - 1e-9:
                break
        return anyio.current_time() - started

    async def _next_change(self) -> None:
        if self._changed is None:
            self._changed = anyio.Event()
        await self._changed.wait()

    def _set_changed(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    async def fetch_state(self, worker: int) -> None:
        truth = self.truth
        seconds = self.model.parameters * truth.state_bytes_per_param / truth.link_bytes_per_s
        if worker in self.failing:
            self.failing.discard(worker)
            await anyio.sleep(seconds / 2)
            raise TrainJoinFailed(f"worker {worker} lost its connection while fetching state")
        await anyio.sleep(seconds)

    async def zero_sync(self, worker: int) -> None:
        await anyio.sleep(self.truth.zero_sync_s)

    async def activate(self, worker: int) -> None:
        await anyio.sleep(self.truth.activate_s)
        self.active.add(worker)
        self._set_changed()

    async def leave(self, worker: int) -> None:
        self.active.discard(worker)
        self._set_changed()
