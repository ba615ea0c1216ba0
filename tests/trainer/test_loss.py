"""The GRPO loss, aggregation, staleness and token logprobs against numbers worked by hand."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from libra.trainer import (
    GRPOConfig,
    aggregation_weights,
    group_advantages,
    grpo_loss,
    importance_weights,
    staleness_weight,
    token_logprobs,
)

# Two sequences of three target positions, old logprobs -1 everywhere.
# A: advantage +1, all three trained, ratios 1.5, 0.9, 1.0.
# B: advantage -2, two trained, ratios 0.5, 1.1, then a tool token (ratio 10, mask 0).
OLD = torch.full((2, 3), -1.0)
RATIOS = torch.tensor([[1.5, 0.9, 1.0], [0.5, 1.1, 10.0]])
NEW = OLD + torch.log(RATIOS)
ADVANTAGES = torch.tensor([[1.0, 1.0, 1.0], [-2.0, -2.0, -2.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
# Per-token losses, max(-A r, -A clip(r, 0.8, 1.2)):
#   A: max(-1.5, -1.2) = -1.2, max(-0.9, -0.9) = -0.9, -1.0          sum -3.1 over 3
#   B: max(2 * 0.5, 2 * 0.8) = 1.6, max(2.2, 2.2) = 2.2              sum  3.8 over 2
TOKEN_MEAN = (-3.1 + 3.8) / 5  # 0.14
SEQ_MEAN_TOKEN_SUM = (-3.1 + 3.8) / 2  # 0.35
SEQ_MEAN_TOKEN_MEAN = (-3.1 / 3 + 3.8 / 2) / 2  # 0.43333


def loss_of(**options: Any) -> tuple[float, dict[str, float]]:
    loss, metrics = grpo_loss(NEW, OLD, ADVANTAGES, MASK, **options)
    return float(loss), metrics.as_floats()


@pytest.mark.parametrize(
    ("aggregation", "expected"),
    [
        ("token-mean", TOKEN_MEAN),
        ("seq-mean-token-sum", SEQ_MEAN_TOKEN_SUM),
        ("seq-mean-token-mean", SEQ_MEAN_TOKEN_MEAN),
    ],
)
def test_loss_matches_the_hand_computed_aggregations(aggregation: str, expected: float) -> None:
    loss, metrics = loss_of(aggregation=aggregation)
    assert loss == pytest.approx(expected, abs=1e-6)
    assert metrics["tokens"] == 5


def test_clipping_on_both_sides_is_counted() -> None:
    _, metrics = loss_of()
    # A's ratio 1.5 (positive advantage) and B's 0.5 (negative advantage) were clipped.
    assert metrics["clip_fraction"] == pytest.approx(2 / 5)
    assert metrics["clip_high_fraction"] == pytest.approx(1 / 5)
    assert metrics["clip_low_fraction"] == pytest.approx(1 / 5)
    # The tool token's ratio of 10 is not a trained token: no statistic sees it.
    assert metrics["ratio_max"] == pytest.approx(1.5)
    assert metrics["ratio_min"] == pytest.approx(0.5)
    assert metrics["ratio_mean"] == pytest.approx((1.5 + 0.9 + 1.0 + 0.5 + 1.1) / 5)


def test_clip_higher_raises_only_the_ceiling() -> None:
    # clip_high 0.28: A's first token costs -1.28 instead of -1.2; B's floor is unchanged.
    loss, _ = loss_of(clip_low=0.2, clip_high=0.28)
    assert loss == pytest.approx((-3.18 + 3.8) / 5, abs=1e-6)
    # clip_low 0.6: B's ratio 0.5 is now clipped at 0.4, below it: the unclipped 1.0 wins.
    loss, _ = loss_of(clip_low=0.6, clip_high=0.2)
    assert loss == pytest.approx((-3.1 + 1.0 + 2.2) / 5, abs=1e-6)


def test_dual_clip_caps_a_negative_advantage_loss() -> None:
    old, new = torch.tensor([[-2.0]]), torch.tensor([[-2.0 + math.log(5.0)]])
    advantage, mask = torch.tensor([[-1.0]]), torch.ones(1, 1)
    plain, _ = grpo_loss(new, old, advantage, mask)
    assert float(plain) == pytest.approx(5.0)  # max(1 * 5, 1 * 1.2)
    capped, metrics = grpo_loss(new, old, advantage, mask, clip_ratio_c=3.0)
    assert float(capped) == pytest.approx(3.0)  # min(5, 1 * 3)
    assert metrics.as_floats()["dual_clip_fraction"] == 1.0


def test_tool_tokens_get_no_gradient() -> None:
    new = NEW.clone().requires_grad_(True)
    loss, _ = grpo_loss(new, OLD, ADVANTAGES, MASK)
    loss.backward()
    assert new.grad is not None
    # d/dlogp of -A r / 5 is -A r / 5 where the unclipped term is taken, and 0 where the
    # clamp is (A's ratio 1.5, B's 0.5) or where the mask is 0 (B's tool token).
    torch.testing.assert_close(new.grad, torch.tensor([[0.0, -0.18, -0.2], [0.0, 0.44, 0.0]]))


def test_kl_to_the_reference_is_k3() -> None:
    logprobs = torch.tensor([[-1.0]])
    ref = torch.tensor([[-1.0 + math.log(2.0)]])
    zero, mask = torch.zeros(1, 1), torch.ones(1, 1)
    loss, metrics = grpo_loss(logprobs, logprobs, zero, mask, kl_coef=0.1, ref_logprobs=ref)
    k3 = 2.0 - math.log(2.0) - 1.0  # exp(x) - x - 1 at x = ln 2: 0.30685
    assert metrics.as_floats()["kl_loss"] == pytest.approx(k3)
    assert float(loss) == pytest.approx(0.1 * k3)
    with pytest.raises(ValueError, match="ref_logprobs"):
        grpo_loss(logprobs, logprobs, zero, mask, kl_coef=0.1)


def test_approx_kl_is_zero_on_policy_and_positive_off_it() -> None:
    _, on_policy = grpo_loss(OLD, OLD, ADVANTAGES, MASK)
    assert on_policy.as_floats()["approx_kl"] == 0.0
    _, off_policy = loss_of()
    # k3 at ratio r is r - 1 - ln r, over the five trained tokens.
    expected = sum(r - 1 - math.log(r) for r in (1.5, 0.9, 1.0, 0.5, 1.1)) / 5
    assert off_policy["approx_kl"] == pytest.approx(expected, rel=1e-5)


def test_the_gap_is_measured_on_the_current_tokens_only() -> None:
    # Current: A's first two tokens (ratios 1.5, 0.9) and B's tool token (off the mask).
    current = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    _, metrics = loss_of(current=current)
    gaps = [abs(math.log(1.5)), abs(math.log(0.9))]
    assert metrics["gap_tokens"] == 2
    assert metrics["gap_mean"] == pytest.approx(sum(gaps) / 2)
    assert metrics["gap_max"] == pytest.approx(max(gaps))
    _, nothing_current = loss_of(current=torch.zeros(2, 3))
    assert nothing_current["gap_tokens"] == 0 and nothing_current["gap_max"] == 0


def test_aggregation_weights_of_padded_rows() -> None:
    weights = aggregation_weights(MASK, "seq-mean-token-mean")
    torch.testing.assert_close(weights, torch.tensor([[1 / 6, 1 / 6, 1 / 6], [1 / 4, 1 / 4, 0]]))
    assert float(aggregation_weights(MASK, "token-mean").sum()) == pytest.approx(1.0)
    assert float(aggregation_weights(MASK, "seq-mean-token-sum").sum()) == pytest.approx(2.5)
    assert aggregation_weights(torch.zeros(2, 3), "token-mean").sum() == 0.0


def test_group_advantages_by_hand() -> None:
    # Rewards 1, 0, 0, 0: mean 0.25, unbiased std sqrt((0.5625 + 3 * 0.0625) / 3) = 0.5.
    assert group_advantages([1.0, 0.0, 0.0, 0.0], epsilon=0.0) == [1.5, -0.5, -0.5, -0.5]
    with_epsilon = group_advantages([1.0, 0.0, 0.0, 0.0], epsilon=0.5)
    assert with_epsilon == pytest.approx([0.75, -0.25, -0.25, -0.25])  # divided by 1.0
    # Dr.GRPO: the mean only.
    assert group_advantages([1.0, 0.0, 0.0, 0.0], scale_by_std=False) == [
        0.75,
        -0.25,
        -0.25,
        -0.25,
    ]
    assert group_advantages([1.0]) == [0.0]
    assert group_advantages([0.5, 0.5, 0.5]) == [0.0, 0.0, 0.0]


def test_staleness_drop_and_reweight() -> None:
    unbounded = GRPOConfig()
    assert staleness_weight(100, unbounded) == 1.0
    drop = GRPOConfig(max_staleness=2, stale="drop")
    assert [staleness_weight(k, drop) for k in (0, 2, 3, 7)] == [1.0, 1.0, 0.0, 0.0]
    reweight = GRPOConfig(max_staleness=2, stale="reweight")
    assert [staleness_weight(k, reweight) for k in (2, 3, 5)] == [1.0, 0.5, 0.125]
    gentle = GRPOConfig(max_staleness=0, stale="reweight", stale_decay=0.9)
    assert staleness_weight(2, gentle) == pytest.approx(0.81)


def test_token_logprobs_divide_by_the_temperature() -> None:
    logits = torch.tensor([[[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]]])
    targets = torch.tensor([[2, 1]])
    # log(e^1 + e^2 + e^3) = log(30.19287) = 3.40761; uniform over 3: -log 3.
    expected = torch.tensor([[3.0 - 3.40761, -math.log(3.0)]])
    torch.testing.assert_close(token_logprobs(logits, targets), expected, atol=1e-5, rtol=0)
    # At temperature 2: log(e^0.5 + e^1 + e^1.5) = log(8.84869) = 2.18027.
    expected = torch.tensor([[1.5 - 2.18027, -math.log(3.0)]])
    hotter = token_logprobs(logits, targets, temperature=2.0)
    torch.testing.assert_close(hotter, expected, atol=1e-5, rtol=0)
    bf16 = token_logprobs(logits.to(torch.bfloat16), targets)
    assert bf16.dtype == torch.float32
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(logits, targets, temperature=0.0)


def test_garbage_off_the_mask_cannot_reach_the_loss() -> None:
    # A tool token whose logprobs would overflow the ratio (e^1000) is not trained.
    new = torch.tensor([[-1.0, 0.0]], requires_grad=True)
    old = torch.tensor([[-1.0, -1000.0]])
    loss, metrics = grpo_loss(new, old, torch.ones(1, 2), torch.tensor([[1.0, 0.0]]))
    loss.backward()
    assert float(loss.detach()) == -1.0  # the trained token, on policy: -A * 1
    assert metrics.as_floats()["ratio_max"] == 1.0
    assert new.grad is not None and new.grad.tolist() == [[-1.0, 0.0]]


# The off-policy correction, with NEW as the trainer's logprobs and OLD the sampler's: the
# clipped ratio is then taken against NEW itself (1 everywhere), so a token's loss is -A
# times its importance weight. Truncated (cap 1.2), per token:
#   A: min(1.5, 1.2) = 1.2, 0.9, 1.0 -> -3.1          B: 0.5, 1.1 -> 2 * 1.6 = 3.2
# Masked, per sequence, the product of its trained tokens' ratios:
#   A: 1.5 * 0.9 * 1.0 = 1.35                         B: 0.5 * 1.1 = 0.55


def test_tis_truncates_each_tokens_ratio_at_the_cap() -> None:
    loss, metrics = loss_of(correction="tis", correction_cap=1.2)
    assert loss == pytest.approx((-3.1 + 3.2) / 5, abs=1e-6)
    assert metrics["is_weight_mean"] == pytest.approx((1.2 + 0.9 + 1.0 + 0.5 + 1.1) / 5)
    assert metrics["is_cut_fraction"] == pytest.approx(1 / 5)
    # The clipped ratio is the trainer's against itself; the mismatch is still the sampler's.
    assert metrics["ratio_min"] == metrics["ratio_max"] == 1.0
    assert metrics["clip_fraction"] == 0.0
    expected = sum(r - 1 - math.log(r) for r in (1.5, 0.9, 1.0, 0.5, 1.1)) / 5
    assert metrics["approx_kl"] == pytest.approx(expected, rel=1e-5)


def test_tis_gradient_is_the_weighted_policy_gradient() -> None:
    new = NEW.clone().requires_grad_(True)
    loss, _ = grpo_loss(new, OLD, ADVANTAGES, MASK, correction="tis", correction_cap=1.2)
    loss.backward()
    assert new.grad is not None
    # d/dnew of -A * w * exp(new - new.detached) / 5 is -A * w / 5; 0 on the tool token.
    expected = torch.tensor([[-1.2, -0.9, -1.0], [2 * 0.5, 2 * 1.1, 0.0]]) / 5
    torch.testing.assert_close(new.grad, expected)


@pytest.mark.parametrize(
    ("cap", "expected_loss", "weight_mean", "cut"),
    [
        (2.0, (-3 * 1.35 + 2 * 2 * 0.55) / 5, (3 * 1.35 + 2 * 0.55) / 5, 0.0),
        (1.3, (2 * 2 * 0.55) / 5, (2 * 0.55) / 5, 3 / 5),  # A is above the cap: masked
    ],
)
def test_mis_weights_each_sequence_by_its_ratio_or_masks_it(
    cap: float, expected_loss: float, weight_mean: float, cut: float
) -> None:
    loss, metrics = loss_of(correction="mis", correction_cap=cap)
    assert loss == pytest.approx(expected_loss, abs=1e-6)
    assert metrics["is_weight_mean"] == pytest.approx(weight_mean)
    assert metrics["is_cut_fraction"] == pytest.approx(cut)


def test_mis_finds_sequences_packed_in_one_row() -> None:
    """The two sequences end to end in one row, then a padding position (index -1)."""
    packed = [torch.cat([t[0], t[1], torch.zeros(1)]).unsqueeze(0) for t in (NEW, OLD)]
    advantages = torch.cat([ADVANTAGES[0], ADVANTAGES[1], torch.zeros(1)]).unsqueeze(0)
    mask = torch.cat([MASK[0], MASK[1], torch.zeros(1)]).unsqueeze(0)
    index = torch.tensor([[0, 0, 0, 1, 1, 1, -1]])
    weights, cut = importance_weights(packed[0], packed[1], mask, "mis", 1.3, index)
    torch.testing.assert_close(weights, torch.tensor([[0, 0, 0, 0.55, 0.55, 0, 0]]))
    torch.testing.assert_close(cut, torch.tensor([[1.0, 1, 1, 0, 0, 0, 0]]))
    loss, _ = grpo_loss(
        packed[0],
        packed[1],
        advantages,
        mask,
        correction="mis",
        correction_cap=1.3,
        sequence_index=index,
    )
    assert float(loss) == pytest.approx((2 * 2 * 0.55) / 5, abs=1e-6)


def test_without_a_correction_every_weight_is_one() -> None:
    _, metrics = loss_of()
    assert metrics["is_weight_mean"] == 1.0 and metrics["is_cut_fraction"] == 0.0
