"""Predictors of a trajectory's remaining output: the prefix tree's, the prompt history's
and the oracle's."""

from __future__ import annotations

import pytest

from libra.sched.policies import (
    OraclePredictor,
    PrefixForest,
    PromptHistoryPredictor,
    Residual,
    Track,
    TreeConfig,
    TreePredictor,
    Truth,
)
from libra.sched.policies._prefix_tree import NO_ESTIMATE

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


def track(trajectory_id: str, generated: int = 0) -> Track:
    return Track(trajectory_id, trajectory_id.split("#")[0], generated=generated)


def test_prompt_history_shrinks_a_prompts_mean_toward_the_global_one() -> None:
    predictor = PromptHistoryPredictor(shrinkage=2.0)
    assert predictor.residual(track("p/1#0")) == NO_ESTIMATE  # nothing finished yet
    for trajectory_id, tokens in (("p/1#0", 1000), ("p/2#0", 3000), ("p/2#1", 3000)):
        predictor.learn(track(trajectory_id), tokens)
    global_mean = 7000 / 3
    total, samples = predictor.total("p/9")  # an unseen prompt
    assert total == pytest.approx(global_mean) and samples == 3
    blended = (2 * 3000 + 2.0 * global_mean) / (2 + 2.0)
    total, samples = predictor.total("p/2")
    assert total == pytest.approx(blended) and samples == 2
    left = predictor.residual(track("p/2#2", generated=2000))
    assert (left.mean, left.upper) == pytest.approx((blended - 2000, blended - 2000))
    assert (left.samples, left.source) == (2, "history")
    assert predictor.residual(track("p/2#3", generated=9000)).mean == 0.0  # never below zero


def test_prompt_history_keeps_the_latest_lengths_of_the_most_recent_prompts() -> None:
    predictor = PromptHistoryPredictor(per_prompt=2, max_prompts=2, shrinkage=0.0)
    for trajectory_id, tokens in (("a/1#0", 100), ("a/1#1", 200), ("a/1#2", 600)):
        predictor.learn(track(trajectory_id), tokens)
    assert predictor.total("a/1") == (400.0, 2)  # the oldest of three fell out of its window
    predictor.learn(track("b/1#0"), 10)
    predictor.learn(track("a/1#3"), 600)  # a/1 is used again, so b/1 is the oldest
    predictor.learn(track("c/1#0"), 20)
    assert list(predictor.prompts) == ["a/1", "c/1"]


def test_the_oracle_predictor_knows_what_is_left_and_learns_nothing() -> None:
    # three turns: 1,000 tokens then a 5 s tool, 2,000 then a 30 s tool, the answer
    truth = Truth({"t/1#0": [(1000, 5.0), (2000, 30.0), (2000, 0.0)]})
    predictor = OraclePredictor(truth)
    live = Track("t/1#0", "t/1", path=[VIEW, FAIL], generated=1200)
    assert predictor.residual(live) == Residual(3800.0, 3800.0, 1, 2, "oracle", 30.0)
    live.generated = 3000  # the second turn is out: its tool has returned
    assert predictor.residual(live).tool_s == 0.0
    lengths_only = OraclePredictor(truth, tool_seconds=False)
    live.generated = 0
    assert lengths_only.residual(live) == Residual(5000.0, 5000.0, 1, 2, "oracle")
    predictor.learn(live, 5000)
    live.generated = 6000
    assert predictor.residual(live).mean == 0.0
