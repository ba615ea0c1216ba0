"""The emulated trainer: a step takes its formula's time on the active workers, and a
worker joining or leaving mid-step re-splits what is left, in virtual time."""

from __future__ import annotations

from typing import Any

import anyio
import pytest
from trio.testing import MockClock

from libra.alloc import A100
from libra.emulation import EmulatedTrainer, TrainTruth
from tests._helpers import SMALL_MODEL

pytestmark = pytest.mark.anyio

TOKENS = 2_000_000


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, Any]]:
    return "trio", {"clock": MockClock(autojump_threshold=0)}


def trainer(*active: int) -> EmulatedTrainer:
    emulated = EmulatedTrainer(A100, SMALL_MODEL, TrainTruth(jitter=0.0))
    emulated.active = set(active)
    return emulated


async def test_a_step_takes_its_formula_on_the_active_workers() -> None:
    emulated = trainer(0, 1)
    started = anyio.current_time()
    took = await emulated.step(TOKENS)
    assert took == pytest.approx(emulated.step_seconds(TOKENS, 2))
    assert anyio.current_time() - started == pytest.approx(took)


async def test_a_worker_joining_halfway_takes_its_share_of_the_rest() -> None:
    emulated = trainer(0)
    alone, pair = emulated.step_seconds(TOKENS, 1), emulated.step_seconds(TOKENS, 2)
    took = 0.0

    async def train() -> None:
        nonlocal took
        took = await emulated.step(TOKENS)

    async with anyio.create_task_group() as group:
        group.start_soon(train)
        await anyio.sleep(alone / 2 - emulated.truth.activate_s)
        await emulated.activate(1)  # active from alone / 2 on
    assert took == pytest.approx(alone / 2 + pair / 2)


async def test_a_step_with_every_worker_gone_waits_for_one() -> None:
    emulated = trainer(0)
    alone = emulated.step_seconds(TOKENS, 1)
    took = 0.0

    async def train() -> None:
        nonlocal took
        took = await emulated.step(TOKENS)

    async with anyio.create_task_group() as group:
        group.start_soon(train)
        await anyio.sleep(alone / 4)
        await emulated.leave(0)
        await anyio.sleep(100.0)
        await emulated.activate(0)
    assert took == pytest.approx(alone + 100.0 + emulated.truth.activate_s)
