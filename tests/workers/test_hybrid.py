"""The hybrid gradient group: a replica joins the core's training and leaves it again,
and every step is the step a trainer of fixed size takes on the same batch, while the
core's world is never rebuilt; one lent mid-step joins the step under way; a replica
that dies or never starts costs no step."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest
import torch

from libra.trainer import GRPOConfig, Train, TrainerConfig, TrainerProcess, TrainResult
from libra.workers import ElasticTrainer
from tests.trainer._ranks import FullParameters, RankPids, assert_close, assert_equal, batch

pytestmark = pytest.mark.anyio

CONFIG = TrainerConfig(backend="gloo", cpu_threads=1, lr=1e-2)
GRPO = GRPOConfig()


def workers() -> dict[int, tuple[int, ...]]:
    cores = sorted(os.sched_getaffinity(0))
    return {0: (cores[0],), 1: (cores[-1],)}  # one core each (the same one on one core)


@asynccontextmanager
async def fixed_and_elastic(
    model: Path, members: tuple[int, ...] = (0,), **elastic: Any
) -> AsyncIterator[tuple[TrainerProcess, ElasticTrainer]]:
    """A one-rank trainer to compare with, and an elastic one whose core is ``members``."""
    async with (
        TrainerProcess(model, CONFIG, world_size=1) as fixed,
        ElasticTrainer(model, CONFIG, workers(), members=members, **elastic) as trainer,
    ):
        yield fixed, trainer


async def active_replica(trainer: ElasticTrainer, worker: int) -> int:
    """Take ``worker`` through fetch, sync and activation; its rank's pid."""
    await trainer.fetch_replica(worker)
    await trainer.sync_replica(worker)
    await trainer.activate_replica(worker)
    (pid,) = await trainer.hybrid.replicas[worker].world.call(RankPids())
    return pid


async def replica_parameters(trainer: ElasticTrainer, worker: int) -> dict[str, torch.Tensor]:
    return await trainer.hybrid.replicas[worker].world.call(FullParameters())


async def test_a_replica_joins_trains_a_share_and_leaves_and_every_step_is_exact(
    tiny_model: Path,
) -> None:
    async with fixed_and_elastic(tiny_model) as (fixed, elastic):

        async def step(seed: int) -> tuple[TrainResult, TrainResult]:
            alone = await fixed.call(Train(batch(seed, ranks=1), GRPO, 1.0))
            shared = await elastic.call(Train(batch(seed, ranks=elastic.world_size), GRPO, 1.0))
            trained = await elastic.call(FullParameters())
            # Shares summed over the bridge, in another order than one rank's sum.
            assert_close(trained, await fixed.call(FullParameters()), atol=1e-5)
            return alone, shared

        await step(0)
        await elastic.fetch_replica(1)  # loads the model folder: the base weights
        assert await elastic.sync_replica(1) == 1  # in step: the core's step count ...
        assert_equal(await replica_parameters(elastic, 1), await elastic.call(FullParameters()))
        assert elastic.world_size == 1  # ... and zero gradients until it is active
        await step(1)
        await elastic.activate_replica(1)
        assert list(elastic.training) == [0, 1] and list(elastic.members) == [0]
        alone, shared = await step(2)  # half the batch on the replica
        assert shared.step.step == alone.step.step == 3
        assert shared.step.loss == pytest.approx(alone.step.loss, rel=1e-5)
        assert shared.step.grad_norm == pytest.approx(alone.step.grad_norm, rel=1e-5)
        assert shared.loss["tokens"] == alone.loss["tokens"]
        assert_equal(await replica_parameters(elastic, 1), await elastic.call(FullParameters()))
        await elastic.drop_replica(1)
        assert list(elastic.training) == [0] and elastic.hybrid.replicas == {}
        await step(3)
    assert elastic.resizes == []  # the core's world was never rebuilt


async def test_a_replica_lent_mid_step_joins_the_step_under_way(tiny_model: Path) -> None:
    async with fixed_and_elastic(tiny_model, in_pieces=True) as (fixed, elastic):
        await elastic.fetch_replica(1)  # loaded beside training, as the pool does it
        results: list[TrainResult] = []

        async def train() -> None:
            results.append(await elastic.call(Train(batch(0, ranks=1), GRPO, 1.0)))

        async with anyio.create_task_group() as group:
            group.start_soon(train)
            while not elastic.hybrid.stepping:  # the step's first piece is under way
                await anyio.lowlevel.checkpoint()
            assert await elastic.sync_replica(1) == 0  # mid-step: no step taken yet
            await elastic.activate_replica(1)
        expected = await fixed.call(Train(batch(0, ranks=1), GRPO, 1.0))
        pieces = len(batch(0, ranks=1).micro_batches)
        shares = elastic.hybrid.shares
        assert shares[None] + shares[1] == pieces and shares[1] > 0, shares
        assert results[0].step.step == 1
        assert results[0].step.loss == pytest.approx(expected.step.loss, rel=1e-5)
        trained = await elastic.call(FullParameters())
        assert_close(trained, await fixed.call(FullParameters()), atol=1e-5)
        assert_equal(await replica_parameters(elastic, 1), trained)
        # A step with nothing to train (its groups' rewards all tied) took no pieces.
        await elastic.call_sized(lambda _: None)
        assert elastic.hybrid.shares == {}
    assert elastic.resizes == []


async def test_a_core_of_two_ranks_takes_a_step_in_pieces_exactly(tiny_model: Path) -> None:
    # Pieces of two micro-batches, the last padded when one is left: what a run with
    # hybrid units does before any is lent.
    async with fixed_and_elastic(tiny_model, (0, 1), in_pieces=True) as (fixed, elastic):
        odd = batch(0, ranks=1)  # five micro-batches: the third piece is padded
        assert len(odd.micro_batches) % 2 == 1
        result = await elastic.call_sized(lambda _: Train(odd, GRPO, 1.0))
        expected = await fixed.call(Train(odd, GRPO, 1.0))
        assert result is not None and elastic.hybrid.shares == {None: len(odd.micro_batches)}
        assert result.step.loss == pytest.approx(expected.step.loss, rel=1e-5)
        assert result.loss["tokens"] == expected.loss["tokens"]
        trained = await elastic.call(FullParameters())
        assert_close(trained, await fixed.call(FullParameters()), atol=1e-5)


@pytest.mark.faults
async def test_a_replica_that_dies_is_dropped_and_its_step_runs_again_without_it(
    tiny_model: Path,
) -> None:
    async with fixed_and_elastic(tiny_model) as (fixed, elastic):
        pid = await active_replica(elastic, 1)
        os.kill(pid, signal.SIGKILL)
        splits: list[int] = []

        def train_on(ranks: int) -> Train:
            splits.append(ranks)
            return Train(batch(0, ranks=ranks), GRPO, 1.0)

        result = await elastic.call_sized(train_on)
        await fixed.call(Train(batch(0, ranks=1), GRPO, 1.0))
        # The core took the pieces the replica failed: one step, the whole batch.
        assert splits == [2] and result is not None and result.step.step == 1
        assert elastic.hybrid.shares == {None: len(batch(0, ranks=2).micro_batches)}
        trained = await elastic.call(FullParameters())
        assert_close(trained, await fixed.call(FullParameters()), atol=1e-5)
        assert [worker for worker, _ in elastic.hybrid.failures] == [1]
        assert list(elastic.training) == [0] and elastic.hybrid.replicas == {}


@pytest.mark.faults
async def test_a_replica_that_hangs_is_cut_once_the_core_s_pieces_say_how_long_one_takes(
    tiny_model: Path,
) -> None:
    async with fixed_and_elastic(tiny_model, piece_patience_s=2) as (fixed, elastic):
        pid = await active_replica(elastic, 1)
        os.kill(pid, signal.SIGSTOP)
        try:
            # Far sooner than the bridge's timeout (600 s): the core's pieces take ~0.1 s.
            with anyio.fail_after(60):
                result = await elastic.call_sized(lambda ranks: Train(batch(0, ranks), GRPO, 1.0))
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        await fixed.call(Train(batch(0, ranks=1), GRPO, 1.0))
        assert result is not None and result.step.step == 1
        assert elastic.hybrid.shares == {None: len(batch(0, ranks=2).micro_batches)}
        trained = await elastic.call(FullParameters())
        assert_close(trained, await fixed.call(FullParameters()), atol=1e-5)
        [(worker, why)] = elastic.hybrid.failures
        assert worker == 1 and "a piece timed out (over 2 s" in why
        assert elastic.hybrid.replicas == {} and list(elastic.training) == [0]
        assert _state(pid) in ("gone", "Z")  # ended with its trainer's process, not left stopped


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "gone"


async def test_a_replica_that_cannot_start_leaves_nothing_behind(tiny_model: Path) -> None:
    cores = workers() | {1: (10_000,)}  # no such core: the rank cannot pin itself
    async with ElasticTrainer(tiny_model, CONFIG, cores, members=(0,)) as elastic:
        with pytest.raises(Exception, match="trainer"):
            await elastic.fetch_replica(1)
        assert elastic.hybrid.replicas == {}
        with pytest.raises(RuntimeError, match="no replica fetched"):
            await elastic.sync_replica(1)
        result = await elastic.call(Train(batch(0, ranks=1), GRPO, 1.0))
        assert result.step.step == 1


@pytest.mark.faults
async def test_a_replica_that_dies_before_it_syncs_fails_its_join_and_costs_no_step(
    tiny_model: Path,
) -> None:
    # The core waits for a missing member to open the bridge up to this long.
    async with ElasticTrainer(
        tiny_model, CONFIG, workers(), members=(0,), bridge_timeout_s=5
    ) as elastic:
        await elastic.fetch_replica(1)
        (pid,) = await elastic.hybrid.replicas[1].world.call(RankPids())
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(RuntimeError, match="worker 1's replica failed to join"):
            await elastic.sync_replica(1)
        assert elastic.hybrid.replicas == {} and elastic.training == (0,)
        result = await elastic.call(Train(batch(0, ranks=1), GRPO, 1.0))
        assert result.step.step == 1
