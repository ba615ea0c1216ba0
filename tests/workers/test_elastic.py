"""The elastic trainer: its world grows 1 -> 2 and shrinks 2 -> 1 between steps, the
parameters crossing each change exactly, and each step after a change is the step a
trainer of fixed size takes on the same batch."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from libra.trainer import GRPOConfig, Train, TrainerConfig, TrainerProcess
from libra.workers import ElasticTrainer
from tests.trainer._ranks import FullParameters, assert_close, assert_equal, batch

pytestmark = pytest.mark.anyio

CONFIG = TrainerConfig(backend="gloo", cpu_threads=1, lr=1e-2)
GRPO = GRPOConfig()


# Each world is processes loading the model: one event loop's run (trio passed too) is enough.
async def test_the_world_grows_and_shrinks_between_steps_and_training_goes_on_exactly(
    tiny_model: Path,
) -> None:
    cores = sorted(os.sched_getaffinity(0))
    workers = {0: (cores[0],), 1: (cores[-1],)}  # one core each (the same one on one core)
    async with (
        TrainerProcess(tiny_model, CONFIG, world_size=1) as fixed,
        ElasticTrainer(tiny_model, CONFIG, workers, members=(0,)) as elastic,
    ):
        for seed, members in enumerate([(0,), (0, 1), (0,)]):
            if members != elastic.members:
                before = await elastic.call(FullParameters())
                await elastic.prepare(members)
                assert elastic.members != members  # the old world trains meanwhile
                assert await elastic.switch() == seed  # the step count came along
                assert elastic.world_size == len(members)
                assert_equal(await elastic.call(FullParameters()), before)
            await fixed.call(Train(batch(seed, ranks=1), GRPO, 1.0))
            await elastic.call(Train(batch(seed, ranks=elastic.world_size), GRPO, 1.0))
            assert_close(await elastic.call(FullParameters()), await fixed.call(FullParameters()))
    assert [resize.members for resize in elastic.resizes] == [(0, 1), (0,)]
