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

    def step_seconds(self, tokens: int, workers: int) -> float:
        """One optimizer step over ``tokens`` on ``workers`` (no sleep: the formula)."""
        truth, params = self.truth, self.model.parameters
        compute = 6 * params * tokens / (workers * self.gpu.dense_bf16_flops * truth.mfu)
        # All-gather in forward and backward, reduce-scatter of gradients, bf16.
        moved = 3 * 2 * params * (workers - 1) / workers
        comm = moved / truth.link_bytes_per_s + 3 * truth.ring_latency_s * (workers - 1)
        noise = math.exp(self._rng.gauss(0.0, truth.jitter)) if truth.jitter else 1.0
        return (compute + comm + truth.overhead_s) * noise

    async def step(self, tokens: int) -> float:
        """Train one optimizer step on the active workers; return the seconds it took."""
        if not self.active:
            raise RuntimeError("no worker is training")
        seconds = self.step_seconds(tokens, len(self.active))
        await anyio.sleep(seconds)
        return seconds

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

    async def leave(self, worker: int) -> None:
        self.active.discard(worker)
