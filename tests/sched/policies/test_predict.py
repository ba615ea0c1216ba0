"""Predictors of a trajectory's remaining output."""

from __future__ import annotations

from libra.sched.policies import PrefixForest, Track, TreeConfig, TreePredictor

FAIL = "run_tests:large:failure"
VIEW = "view_file:medium:success"


def forest(**config: int | float) -> PrefixForest:
    return PrefixForest(TreeConfig.model_validate({"min_samples": 1, **config}))


def test_the_tree_predictor_learns_the_remaining_output_from_a_track() -> None:
    predictor = TreePredictor(forest())
    finished = Track("swe/1#0", "swe/1", path=[VIEW, FAIL], marks=[500, 2500], generated=4000)
    predictor.learn(finished, output_tokens=4000)
    live = Track("swe/2#0", "swe/2", path=[VIEW, FAIL], marks=[600, 2600], generated=2600)
    assert predictor.residual(live).mean == 1500
    assert predictor.residual(Track("swe/3#0", "swe/3")).mean == 4000
