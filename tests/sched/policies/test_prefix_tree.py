"""The causal prefix tree: learning from finished trajectories, bounds, persistence."""

from __future__ import annotations

from pathlib import Path

import pytest

from libra.sched.policies import PrefixForest, PrefixTree, TreeConfig

FAIL = "run_tests:large:failure"
PASS = "run_tests:small:success"
VIEW = "view_file:medium:success"


def forest(**config: int | float) -> PrefixForest:
    return PrefixForest(TreeConfig.model_validate({"min_samples": 1, **config}))


def test_insert_records_the_remaining_output_at_every_node_of_the_path() -> None:
    tree = PrefixTree()
    tree.insert([VIEW, FAIL], [1000, 800, 300])
    (node, depth), *_ = tree.along([VIEW, FAIL], min_samples=1)
    assert depth == 2 and list(node.samples.values) == [300]
    assert [depth for _, depth in tree.along([VIEW, FAIL], min_samples=1)] == [2, 1, 0]
    ((root, _),) = tree.along([], min_samples=1)
    assert list(root.samples.values) == [1000]
    with pytest.raises(ValueError, match="one value per state"):
        tree.insert([VIEW], [1000])


def test_a_failing_check_predicts_more_output_than_a_passing_one() -> None:
    trees = forest()
    for _ in range(10):
        trees.observe("swe/1", [VIEW, FAIL, VIEW, FAIL, PASS], [9000, 8000, 6000, 5000, 2000, 200])
        trees.observe("swe/2", [VIEW, PASS], [1500, 1200, 200])
    after_failure = trees.residual("swe/3", [VIEW, FAIL], marks=[1000, 3000], generated=3000)
    after_pass = trees.residual("swe/3", [VIEW, PASS], marks=[300, 1300], generated=1300)
    assert after_failure.mean == 6000 and after_failure.depth == 2
    assert after_pass.mean == 200
    assert after_failure.source == after_pass.source == "global"


def test_the_prompts_own_tree_wins_when_it_matches_as_deep() -> None:
    trees = forest()
    for _ in range(5):
        trees.observe("swe/hard", [FAIL], [20000, 18000])
        trees.observe("swe/easy", [FAIL], [2000, 1000])
    own = trees.residual("swe/hard", [FAIL], marks=[2000], generated=2000)
    other = trees.residual("swe/new", [FAIL], marks=[2000], generated=2000)
    assert (own.source, own.mean) == ("prompt", 18000)
    assert other.source == "global" and other.mean == (18000 + 1000) / 2


def test_a_shallow_match_is_conditioned_on_the_tokens_generated_since() -> None:
    trees = forest()
    for total in (1000, 2000, 3000, 4000):
        trees.observe("swe/1", [], [total])
    # 2,500 tokens in, with no tool return yet: only the 3,000 and 4,000 runs are alike.
    estimate = trees.residual("swe/2", [VIEW], marks=[2500], generated=2500)
    assert estimate.depth == 0
    assert estimate.mean == pytest.approx((500 + 1500) / 2)
    assert estimate.upper == 1500


def test_longer_than_everything_seen_falls_back_to_trajectories_that_long() -> None:
    trees = forest()
    trees.observe("swe/1", [FAIL], [10000, 2000])
    trees.observe("swe/1", [PASS], [3000, 100])
    # 2,500 tokens after its failure: longer than any trajectory after a failure, but
    # the global root knows one trajectory that went past 5,000 tokens in all.
    estimate = trees.residual("swe/2", [FAIL], marks=[5000], generated=7500)
    assert (estimate.depth, estimate.mean) == (0, 2500)
    assert trees.residual("swe/2", [FAIL], marks=[5000], generated=20000).samples == 0


def test_an_answer_needs_min_samples_that_went_on_longer_than_the_trajectory() -> None:
    trees = forest(min_samples=2)
    for total, after in ((3000, 1000), (4000, 2000), (13000, 11000)):
        trees.observe("swe/1", [FAIL], [total, after])
    for total in (20000, 22000):
        trees.observe("swe/1", [PASS], [total, 100])
    # 10,500 tokens after its failure: one trajectory went on that long after a failure,
    # too few to answer; of all trajectories, three went past its 12,500 in all.
    estimate = trees.residual("swe/2", [FAIL], marks=[2000], generated=12500)
    assert (estimate.depth, estimate.samples) == (0, 3)
    assert estimate.mean == pytest.approx((500 + 7500 + 9500) / 3)


def test_an_unseen_path_is_answered_by_its_last_state_at_its_depth_before_its_parent() -> None:
    trees = forest(min_samples=2)
    for _ in range(2):
        trees.observe("swe/1", [VIEW, FAIL], [9000, 8500, 6000])
        trees.observe("swe/2", [FAIL, FAIL], [9000, 8000, 5000])
        trees.observe("swe/3", [FAIL, PASS], [3000, 2500, 100])
    # [PASS, FAIL] was never seen: a failure as the second state was followed by 6,000
    # and 5,000 tokens, whatever came first; its parent [PASS] is unknown too.
    estimate = trees.residual("swe/4", [PASS, FAIL], marks=[400, 900], generated=900)
    assert (estimate.depth, estimate.samples, estimate.mean) == (2, 4, 5500)
    restored = PrefixForest.from_bytes(trees.to_bytes())
    again = restored.residual("swe/4", [PASS, FAIL], marks=[400, 900], generated=900)
    assert again == estimate


def test_nodes_keep_only_the_latest_samples_so_the_tree_follows_drift() -> None:
    trees = forest(max_samples=3)
    for total in (100, 200, 300, 400, 500):
        trees.observe("p/1", [], [total])
    estimate = trees.residual("p/2", [])
    assert estimate.samples == 3 and estimate.mean == 400


def test_trees_stop_growing_at_their_node_and_depth_limits() -> None:
    trees = forest(max_nodes=3, max_depth=2, max_prompt_nodes=2)
    trees.observe("p/1", ["a", "b", "c", "d"], [40, 30, 20, 10, 0])
    trees.observe("p/1", ["x"], [5, 1])
    assert trees.global_tree.node_count == 3  # root, a, a/b: depth 2, then full
    assert trees.prompts["p/1"].node_count == 2
    assert trees.residual("p/2", ["a", "b", "c"]).depth == 2


def test_per_prompt_trees_are_evicted_least_recently_used() -> None:
    trees = forest(max_prompts=2)
    for prompt in ("p/1", "p/2", "p/1", "p/3"):
        trees.observe(prompt, [], [100])
    assert list(trees.prompts) == ["p/1", "p/3"]


def test_min_samples_hides_nodes_with_too_little_evidence() -> None:
    trees = PrefixForest(TreeConfig(min_samples=3))
    trees.observe("p/1", [FAIL], [5000, 4000])
    trees.observe("p/1", [FAIL], [6000, 5000])
    assert trees.residual("p/2", [FAIL]).samples == 0
    trees.observe("p/3", [PASS], [500, 100])
    estimate = trees.residual("p/2", [FAIL])
    assert (estimate.depth, estimate.samples) == (0, 3)


def test_the_forest_survives_a_save_and_restore(tmp_path: Path) -> None:
    trees = forest(max_samples=4, demote_quantile=0.97)
    for index in range(6):
        trees.observe(f"p/{index % 2}", [VIEW, FAIL], [900 + index, 700 + index, 400 + index])
    path = tmp_path / "cmlfq-tree.json"
    trees.save(path)
    restored = PrefixForest.load(path)
    assert restored.config == trees.config
    assert list(restored.prompts) == list(trees.prompts)
    for prompt in ("p/0", "p/1", "p/new"):
        for path_so_far in ([], [VIEW], [VIEW, FAIL]):
            assert restored.residual(prompt, path_so_far) == trees.residual(prompt, path_so_far)
    # The ring buffer keeps its order: the next sample replaces the oldest.
    trees.observe("p/0", [], [0])
    restored.observe("p/0", [], [0])
    assert restored.residual("p/x", []) == trees.residual("p/x", [])
    assert not (tmp_path / "cmlfq-tree.json.tmp").exists()


def test_a_file_of_another_format_version_is_refused() -> None:
    data = forest().to_bytes().replace(b'"version":1', b'"version":99')
    with pytest.raises(ValueError, match="format 99"):
        PrefixForest.from_bytes(data)
