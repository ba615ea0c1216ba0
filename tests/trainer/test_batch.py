"""Batches from records: the rules for what trains, the token layout, and micro-batches."""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from envs_contrib.calc import Calc
from libra.engine import (
    EngineConfig,
    SamplingConfig,
    TrajectoryRecord,
    WeightSpan,
    jobs_for,
    join_pieces,
    rollout,
)
from libra.trainer import (
    Aggregation,
    Batch,
    BatchLayout,
    Correction,
    GRPOConfig,
    Sample,
    TrainConfig,
    build_batch,
    grpo_loss,
    micro_batch_logprobs,
    plan_micro_batches,
    token_logprobs,
)
from tests._helpers import emulated_engine
from tests._helpers import scripted_record as record


def batch_of(records: Sequence[TrajectoryRecord], *, current: int = 0, **options: Any) -> Batch:
    """A batch of ``records``; ``options`` are ``GRPOConfig`` and ``TrainConfig`` fields."""
    grpo = GRPOConfig(**{k: v for k, v in options.items() if k in GRPOConfig.model_fields})
    train = TrainConfig(**{k: v for k, v in options.items() if k in TrainConfig.model_fields})
    samples = [Sample.from_record(r) for r in records]
    return build_batch(samples, current_version=current, grpo=grpo, train=train)


def test_targets_mask_and_logprobs_are_shifted_by_one() -> None:
    sampled = record("a", 1.0, [0, 0, 1, 1, 0], ids=[5, 6, 7, 8, 9], logprobs=[0, 0, -0.1, -0.2, 0])
    other = record("b", 0.0, [0, 1, 1])
    batch = batch_of([sampled, other], layout="padded")
    [micro] = batch.micro_batches
    row = micro.sample_ids.index("a")
    assert micro.input_ids[row].tolist() == [5, 6, 7, 8]
    assert micro.targets[row].tolist() == [6, 7, 8, 9]
    assert micro.position_ids[row].tolist() == [0, 1, 2, 3]
    assert micro.loss_mask[row].tolist() == [0, 1, 1, 0]
    torch.testing.assert_close(micro.old_logprobs[row], torch.tensor([0, -0.1, -0.2, 0]))
    # Rewards 1 and 0: mean 0.5, unbiased std sqrt(0.5), epsilon 1e-6:
    # (1 - 0.5) / (0.70711 + 1e-6) = 0.70711.
    high = 0.5 / (math.sqrt(0.5) + 1e-6)
    assert batch.advantages == pytest.approx({"a": high, "b": -high})
    torch.testing.assert_close(micro.advantages[row], torch.full((4,), high))
    # token-mean over the batch's 2 + 2 trained tokens.
    assert micro.loss_weights[row].tolist() == [0, 0.25, 0.25, 0]
    # "b" is shorter: right padding, out of the attention and the loss.
    short = 1 - row
    assert micro.attention_mask is not None
    assert micro.attention_mask[short].tolist() == [1, 1, 0, 0]
    assert micro.sample_index[short].tolist() == [short, short, -1, -1]
    assert micro.loss_weights[short].tolist() == [0.25, 0.25, 0, 0]


def test_current_marks_the_targets_the_trained_weights_sampled() -> None:
    """One-step-off: a turn sampled on v0, the sync, a turn on v1; the batch trains v1."""
    mixed = record("a", 1.0, [0, 1, 1, 0, 1, 1])
    mixed.weight_versions = [WeightSpan(1, 3, 0), WeightSpan(4, 6, 1)]
    old = record("b", 0.0, [0, 1, 1])
    batch = batch_of([mixed, old], current=1, layout="padded", max_staleness=1)
    [micro] = batch.micro_batches
    row = micro.sample_ids.index("a")
    assert micro.current[row].tolist() == [0, 0, 0, 1, 1]  # targets: ids 1..5
    assert micro.current[1 - row].tolist() == [0, 0, 0, 0, 0]


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_an_episode_in_pieces_is_one_sample_of_several_sequences(layout: BatchLayout) -> None:
    """A client edited its history: two contexts, each exact, one reward for both."""
    first = record("a", None, [0, 1, 1], ids=[5, 6, 7])
    second = record("a", 1.0, [0, 0, 1, 1, 1], ids=[5, 8, 9, 10, 11])
    episode = join_pieces([first, second])
    other = record("b", 0.0, [0, 1, 1])
    batch = batch_of([episode, other], layout=layout)
    assert [s.id for s in batch.samples] == ["a", "b"] and not batch.dropped
    assert batch.samples[0].positions == 2 + 4 and batch.samples[0].trained_tokens == 5
    [micro] = batch.micro_batches
    assert micro.sample_ids.count("a") == 2
    rows = [i for i, sample_id in enumerate(micro.sample_ids) if sample_id == "a"]
    bounds = micro.cu_seqlens.tolist()
    pieces = []
    for row in rows:  # each piece its own sequence: no target crosses from one to the next
        if layout == "packed":
            at: Any = (0, slice(bounds[row], bounds[row + 1]))
        else:
            assert micro.attention_mask is not None
            at = (row, micro.attention_mask[row].bool())
        ids, targets = micro.input_ids[at].tolist(), micro.targets[at].tolist()
        pieces.append((ids, targets, micro.position_ids[at].tolist()))
        advantages = micro.advantages[at].tolist()
        assert advantages == pytest.approx([batch.advantages["a"]] * len(advantages))
        # token-mean over the batch's 5 + 2 trained tokens, piece by piece
        weights = micro.loss_weights[at]
        assert weights[weights > 0].tolist() == pytest.approx([1 / 7] * int((weights > 0).sum()))
    assert sorted(pieces) == [
        ([5, 6], [6, 7], [0, 1]),
        ([5, 8, 9, 10], [8, 9, 10, 11], [0, 1, 2, 3]),
    ]


def test_failed_lone_equal_and_inexact_records_leave_the_batch() -> None:
    mask = [0, 1, 1]
    records = [
        # g: scored rewards 1, 0, the drift record's 1 and the truncated record's 0.
        record("g1", 1.0, mask),
        record("g0", 0.0, mask),
        record("g-failed", None, mask, status="failed"),
        record("g-drift", 1.0, mask, tokens="drift"),
        record("g-truncated", 0.0, mask, status="truncated"),
        # lone: one scored sample (the other failed): no baseline.
        record("lone", 1.0, mask, group="lone"),
        record("lone-failed", None, mask, group="lone", status="failed"),
        # same: equal rewards, no signal.
        record("same1", 0.5, mask, group="same"),
        record("same2", 0.5, mask, group="same"),
    ]
    batch = batch_of(records)
    assert [s.id for s in batch.samples] == ["g1", "g0", "g-truncated"]
    assert batch.dropped == Counter(
        {"failed": 2, "tokens drift": 1, "lone sample": 1, "equal rewards": 2}
    )
    # g's scored rewards 1, 0, 1, 0: mean 0.5, unbiased std sqrt(1/3) = 0.57735.
    high = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    low = -high
    assert batch.advantages["g1"] == pytest.approx(high)
    assert batch.advantages["g0"] == pytest.approx(low)
    assert batch.advantages["g-drift"] == pytest.approx(high)
    assert batch.advantages["g-truncated"] == pytest.approx(low)
    assert "g-failed" not in batch.advantages
    assert batch.advantages["same1"] == batch.advantages["lone"] == 0.0


def test_dr_grpo_advantages_are_not_scaled() -> None:
    records = [record("a", 1.0, [0, 1]), record("b", 0.0, [0, 1]), record("c", 0.0, [0, 1])]
    batch = batch_of(records, scale_by_std=False)
    assert batch.advantages == pytest.approx({"a": 2 / 3, "b": -1 / 3, "c": -1 / 3})


@pytest.mark.parametrize(("stale", "old_weight"), [("drop", None), ("reweight", 0.25)])
def test_stale_samples_are_dropped_or_reweighted(stale: str, old_weight: float | None) -> None:
    # Weights are at version 5; the bound is 2; "old" is 4 versions behind.
    records = [
        record("new", 1.0, [0, 1, 1], version=5),
        record("edge", 0.0, [0, 1, 1], version=3),
        record("old", 0.0, [0, 1, 1], version=1),
    ]
    batch = batch_of(records, current=5, max_staleness=2, stale=stale, layout="padded")
    [micro] = batch.micro_batches
    # The group's statistics include the stale sample: it is a genuine outcome.
    assert batch.advantages["new"] == pytest.approx(2 / math.sqrt(3), rel=1e-5)
    versions = dict(zip(micro.sample_ids, micro.weight_versions.tolist(), strict=True))
    if old_weight is None:
        assert batch.dropped == Counter({"stale": 1})
        assert versions == {"new": 5, "edge": 3}
        expected = {"new": 0.25, "edge": 0.25}  # token-mean over 4 tokens
    else:
        assert not batch.dropped
        assert versions == {"new": 5, "edge": 3, "old": 1}
        # 2 ** -(4 - 2) = 0.25 of its token-mean weight over 6 tokens.
        expected = {"new": 1 / 6, "edge": 1 / 6, "old": old_weight / 6}
    for row, sample_id in enumerate(micro.sample_ids):
        weight = expected[sample_id]
        assert micro.loss_weights[row].tolist() == pytest.approx([weight, weight])


def test_micro_batches_are_first_fit_decreasing_under_the_budget() -> None:
    lengths = [9, 7, 5, 3, 2]
    packed = plan_micro_batches(lengths, TrainConfig(micro_batch_tokens=10, layout="packed"))
    assert packed == [[0], [1, 3], [2, 4]]
    padded = plan_micro_batches(lengths, TrainConfig(micro_batch_tokens=10, layout="padded"))
    assert padded == [[0], [1], [2, 3], [4]]
    # A sample longer than the budget goes alone.
    assert plan_micro_batches([30, 4], TrainConfig(micro_batch_tokens=10)) == [[0], [1]]


def test_micro_batches_come_in_a_multiple_of_the_ranks() -> None:
    roomy = TrainConfig(micro_batch_tokens=100)
    assert plan_micro_batches([5, 4, 3, 2, 1], roomy) == [[0, 1, 2, 3, 4]]
    assert plan_micro_batches([5, 4, 3, 2, 1], roomy, ranks=2) == [[0, 2, 4], [1, 3]]
    # 5 samples, 3 ranks: the 3-sample half is cut again.
    assert plan_micro_batches([5, 4, 3, 2, 1], roomy, ranks=3) == [[1, 3], [0, 4], [2]]
    with pytest.raises(ValueError, match="equal shares"):
        plan_micro_batches([5, 4, 3], roomy, ranks=4)


def test_each_rank_gets_as_many_micro_batches() -> None:
    rng = random.Random(2)
    records = [
        record(f"s{i}", float(i % 2), [0] * 3 + [1] * rng.randrange(1, 12), group=f"g{i // 4}")
        for i in range(13)
    ]
    samples = [Sample.from_record(r) for r in records]
    train = TrainConfig(micro_batch_tokens=24)
    batch = build_batch(samples, current_version=0, train=train, ranks=3)
    assert len(batch.micro_batches) >= 3
    shares = [batch.for_rank(rank) for rank in range(3)]
    assert len({len(share) for share in shares}) == 1
    dealt = [id(micro) for share in shares for micro in share]
    assert sorted(dealt) == sorted(id(micro) for micro in batch.micro_batches)
    # The token-mean weights of all ranks together still sum to 1.
    total = sum(float(m.loss_weights.sum()) for share in shares for m in share)
    assert total == pytest.approx(1.0)
    with pytest.raises(ValueError, match="rank 3"):
        batch.for_rank(3)


def test_every_position_appears_once_in_packed_micro_batches() -> None:
    rng = random.Random(0)
    records = [
        record(f"s{i}", float(i % 2), [0] * 3 + [1] * rng.randrange(1, 9), group=f"g{i // 4}")
        for i in range(12)
    ]
    batch = batch_of(records, micro_batch_tokens=16, layout="packed")
    assert len(batch.micro_batches) > 1
    seen: Counter[str] = Counter()
    for micro in batch.micro_batches:
        assert micro.input_ids.shape[0] == 1
        assert micro.positions <= 16 or len(micro.sample_ids) == 1
        bounds = micro.cu_seqlens.tolist()
        for i, sample_id in enumerate(micro.sample_ids):
            source = next(r for r in records if r.id == sample_id)
            span = slice(bounds[i], bounds[i + 1])
            assert micro.input_ids[0, span].tolist() == source.token_ids[:-1]
            assert micro.targets[0, span].tolist() == source.token_ids[1:]
            assert micro.position_ids[0, span].tolist() == list(range(len(source.token_ids) - 1))
            assert set(micro.sample_index[0, span].tolist()) == {i}
            seen[sample_id] += 1
    assert seen == Counter({r.id: 1 for r in records})
    total = sum(float(m.loss_weights.sum()) for m in batch.micro_batches)
    assert total == pytest.approx(1.0)  # token-mean weights of the whole batch


# ---------------------------------------------- packed and padded give the same loss


@pytest.fixture(scope="module")
def tiny_model() -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    return transformers.LlamaForCausalLM(config)


def step_loss(model: torch.nn.Module, batch: Batch, grpo: GRPOConfig) -> torch.Tensor:
    total = torch.zeros(())
    for micro in batch.micro_batches:
        loss, _ = micro.loss(micro_batch_logprobs(model, micro), grpo)
        total = total + loss
    return total


@pytest.fixture(scope="module")
def model_samples(tiny_model: torch.nn.Module) -> list[Sample]:
    return [Sample.from_record(r) for r in model_records(tiny_model)]


def model_records(model: torch.nn.Module) -> list[TrajectoryRecord]:
    """Records whose logprobs are the model's own, nudged, so some ratios clip."""
    rng = random.Random(1)
    records = []
    for i in range(10):
        n = rng.randrange(6, 20)
        ids = [rng.randrange(64) for _ in range(n)]
        mask = [0] * 3 + [rng.choice((0, 1, 1)) for _ in range(n - 3)]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids[:-1]]), use_cache=False).logits
            own = token_logprobs(logits, torch.tensor([ids[1:]]))[0].tolist()
        logprobs = [0.0] + [p + rng.uniform(-0.3, 0.3) for p in own]
        records.append(
            record(
                f"s{i}",
                float(rng.random() < 0.5),
                mask,
                ids=ids,
                logprobs=logprobs,
                group=f"g{i // 5}",
            )
        )
    return records


@pytest.mark.parametrize(
    ("aggregation", "correction"),
    [
        ("token-mean", "none"),
        ("seq-mean-token-sum", "none"),
        ("seq-mean-token-mean", "none"),
        ("token-mean", "tis"),
        ("seq-mean-token-mean", "mis"),
    ],
)
def test_packed_and_padded_micro_batches_give_the_whole_batch_loss(
    tiny_model: torch.nn.Module,
    model_samples: list[Sample],
    aggregation: Aggregation,
    correction: Correction,
) -> None:
    """With a correction too: ``mis`` judges each sequence whole, wherever it is packed."""
    grpo = GRPOConfig(aggregation=aggregation, correction=correction, correction_cap=1.3)
    samples = model_samples

    def batch(layout: BatchLayout, budget: int) -> Batch:
        train = TrainConfig(layout=layout, micro_batch_tokens=budget)
        return build_batch(samples, current_version=0, grpo=grpo, train=train)

    # The reference: every sample in one padded micro-batch, weights from its rows.
    [whole] = batch("padded", 10_000).micro_batches
    reference, metrics = grpo_loss(
        micro_batch_logprobs(tiny_model, whole),
        whole.old_logprobs,
        whole.advantages,
        whole.loss_mask,
        aggregation=aggregation,
        correction=correction,
        correction_cap=grpo.correction_cap,
    )
    if correction != "none":  # the cap cuts some tokens, and keeps others
        assert 0 < metrics.is_cut_fraction < 1
    packed, padded = batch("packed", 40), batch("padded", 40)
    assert len(packed.micro_batches) > 1 and len(padded.micro_batches) > 1
    torch.testing.assert_close(step_loss(tiny_model, packed, grpo), reference)
    torch.testing.assert_close(step_loss(tiny_model, padded, grpo), reference)


@pytest.mark.parametrize("pieces", [False, True])
def test_packed_and_padded_give_the_same_gradients(
    tiny_model: torch.nn.Module, model_samples: list[Sample], pieces: bool
) -> None:
    """With ``pieces``, two records are one episode's two contexts: packed end to end in
    a row, neither may attend to the other."""
    samples, grpo = model_samples, GRPOConfig()
    if pieces:
        records = model_records(tiny_model)
        episode = join_pieces(records[6:8])
        samples = [Sample.from_record(r) for r in [*records[:6], episode, *records[8:]]]
        rows = build_batch(samples, current_version=0, train=TrainConfig(micro_batch_tokens=40))
        assert any(micro.sample_ids.count(episode.id) == 2 for micro in rows.micro_batches)

    def gradients(layout: str) -> list[torch.Tensor]:
        train = TrainConfig(layout=layout, micro_batch_tokens=40)
        tiny_model.zero_grad()
        step_loss(
            tiny_model, build_batch(samples, current_version=0, grpo=grpo, train=train), grpo
        ).backward()
        return [p.grad.clone() for p in tiny_model.parameters() if p.grad is not None]

    packed, padded = gradients("packed"), gradients("padded")
    assert any(bool(g.abs().sum() > 0) for g in packed)
    for a, b in zip(packed, padded, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)


# ---------------------------------------------- batches from the engine's own records


class ParityCalc(Calc):
    """Calc whose reward varies between samples of a task: the answer's length parity."""

    def reward(self, answer: str) -> float:
        return float(len(answer) % 2)


@pytest.mark.anyio
async def test_batches_from_a_real_rollout() -> None:
    config = EngineConfig(concurrency=1, max_attempts=1, sampling=SamplingConfig(seed=7))
    async with emulated_engine(config=config, error_rate=0.1) as (engine, records):
        await rollout(jobs_for(ParityCalc, "parity", 16, samples_per_prompt=4, seed=3), engine)
    failed = sum(r.status == "failed" for r in records)
    assert failed and len(records) == 16
    batch = build_batch(
        [Sample.from_record(r) for r in records],
        current_version=0,
        train=TrainConfig(micro_batch_tokens=2048),
    )
    assert batch.samples and batch.dropped["failed"] == failed
    assert len(batch.samples) + sum(batch.dropped.values()) == 16
    by_id = {r.id: r for r in records}
    trained = 0
    for micro in batch.micro_batches:
        bounds = micro.cu_seqlens.tolist()
        for i, sample_id in enumerate(micro.sample_ids):
            source, span = by_id[sample_id], slice(bounds[i], bounds[i + 1])
            assert micro.input_ids[0, span].tolist() == source.token_ids[:-1]
            assert micro.loss_mask[0, span].tolist() == source.loss_mask[1:]
            sampled = [
                p for p, m in zip(source.logprobs[1:], source.loss_mask[1:], strict=True) if m
            ]
            kept = micro.old_logprobs[0, span][micro.loss_mask[0, span] > 0].tolist()
            assert kept == pytest.approx(sampled)
            trained += sum(source.loss_mask[1:])
    assert trained == batch.trained_tokens
    # On policy (the rollout's own logprobs), every ratio is 1: the loss is minus the
    # token-weighted mean advantage.
    expected = (
        -sum(batch.advantages[s.id] * s.trained_tokens for s in batch.samples)
        / batch.trained_tokens
    )
    total = 0.0
    for micro in batch.micro_batches:
        loss, metrics = micro.loss(micro.old_logprobs, GRPOConfig())
        total += float(loss)
        assert metrics.as_floats()["clip_fraction"] == 0.0
    assert total == pytest.approx(expected, abs=1e-5)


def test_a_micro_batch_moves_whole() -> None:
    batch = batch_of([record("a", 1.0, [0, 1, 1]), record("b", 0.0, [0, 1])], layout="padded")
    [micro] = batch.micro_batches
    moved = micro.to("meta")
    assert moved.attention_mask is not None  # a padded micro-batch has one
    assert moved.input_ids.device.type == moved.attention_mask.device.type == "meta"
    assert moved.sample_ids == micro.sample_ids and micro.input_ids.device.type == "cpu"
