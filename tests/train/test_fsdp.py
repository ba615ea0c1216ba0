"""The FSDP2 trainer: 2 gloo ranks compute the gradients one process computes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from libra.train import TrainerConfig, spawn, split_by_tokens
from tests.train._workers import fixed_batch, rank_gradients, reference_gradients

VOCAB = 49152  # SmolLM2's


@pytest.mark.slow
def test_two_gloo_ranks_compute_the_single_process_gradients(embedded_model: Path) -> None:
    batch = fixed_batch(VOCAB, sequences=4, length=48)
    config = TrainerConfig(backend="gloo", cpu_threads=1)

    ranks = spawn(2, rank_gradients, embedded_model, batch, config)
    expected, expected_loss = reference_gradients(embedded_model, batch)

    for grads, loss in ranks:
        assert loss == pytest.approx(expected_loss, rel=1e-5)
        assert grads.keys() == expected.keys()
        worst = max(float((grads[k] - expected[k]).abs().max()) for k in expected)
        scale = max(float(g.abs().max()) for g in expected.values())
        # fp32 sums in another order (per sequence, then across ranks): rounding only.
        assert worst <= 1e-5 * scale, (worst, scale)
    assert all(float(g.abs().sum()) > 0 for g in expected.values())


def test_split_by_tokens_packs_in_order_within_the_budget() -> None:
    items = ["a", "b", "c", "d", "e"]
    assert split_by_tokens(items, [3, 3, 5, 9, 1], max_tokens=6) == [
        ["a", "b"],
        ["c"],
        ["d"],
        ["e"],
    ]
    assert split_by_tokens([], [], max_tokens=4) == []
    with pytest.raises(ValueError, match="lengths"):
        split_by_tokens(items, [1], max_tokens=4)


def test_trainer_config_defaults_pick_the_backend_and_precision_from_the_device() -> None:
    config = TrainerConfig()
    assert (config.backend, config.mixed_precision) == ("auto", "auto")
    with pytest.raises(ValueError):
        TrainerConfig(mixed_precision="fp16")  # type: ignore[arg-type]
    assert torch.float32.is_floating_point
