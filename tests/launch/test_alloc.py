"""The run's planner: the model's shape from its folder, priced as the run routes."""

from __future__ import annotations

from pathlib import Path

from libra.launch import rule_planner
from tests._helpers import tiny_llama


def test_the_planner_prices_the_longest_trajectory_as_the_run_routes_it(
    tmp_path: Path,
) -> None:
    """The model's shape comes from its folder; C-MLFQ gives the long trajectories
    instances of their own, least-loaded spreads their turns through full batches."""
    model = tiny_llama(tmp_path / "model")
    planner = rule_planner(model, "A100", "cmlfq")
    assert planner.config.longest_decodes == "alone"
    assert rule_planner(model, "A100", "least-loaded").config.longest_decodes == "in_batch"
    shape = planner.rollout.roofline.model
    assert (shape.layers, shape.kv_heads, shape.head_dim) == (2, 2, 8)
    # Per layer: q and o 32x32, k and v 32x16, three 32x64 MLP matrices, two norms.
    layer = 2 * 32 * 32 + 2 * 32 * 16 + 3 * 32 * 64 + 2 * 32
    assert shape.parameters == 320 * 32 + 2 * layer + 32  # tied embeddings, final norm
