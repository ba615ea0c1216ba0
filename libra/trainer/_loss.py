"""The GRPO loss, its aggregation over tokens, the staleness rule, and token logprobs.

Every tensor argument is shaped like the tokens (``[rows, length]``, padded or packed) and
aligned to the *targets*: position ``t`` holds the logprob of the token that follows
input ``t``. Only positions whose ``mask`` is 1 (tokens the model sampled) are trained.

**Aggregation** is expressed as per-token weights whose weighted sum is the loss, so a
batch split into micro-batches, or laid out packed instead of padded, sums to the same
loss as the whole batch computed at once (the weights are computed over the whole batch,
see ``aggregation_weights`` and ``libra.trainer._batch``). The modes, as peers name them:

- ``token-mean``: every trained token of the batch weighs ``1 / N`` (``N`` trained tokens
  in the batch); long answers weigh more in total, as in DAPO.
- ``seq-mean-token-sum``: every trained token weighs ``1 / S`` (``S`` sequences): each
  sequence's token losses are summed, then averaged over sequences: no length
  normalisation, as Dr.GRPO (which also divides by a constant length, a mere scale).
- ``seq-mean-token-mean``: a token of sequence ``i`` weighs ``1 / (S * n_i)``: the
  original GRPO mean per sequence, then over sequences; every sequence weighs the same.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from libra.trainer._kinds import Aggregation, Correction

if TYPE_CHECKING:  # a pydantic section: the loss itself runs without pydantic
    from libra.trainer._config import GRPOConfig

# The k3 estimator's exponent is clamped, as peers do, so one wild token cannot blow up.
_KL_CLAMP = 10.0
_RATIO_CLAMP = 20.0


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Log-softmax of ``logits / temperature`` gathered at ``targets``.

    ``logits`` is ``[..., vocab]`` and ``targets`` the matching ``[...]`` ids. The
    temperature must match what the server's logprobs mean, or the ratio against the
    rollout logprobs is off before training changes anything. vLLM (0.32) returns
    ``raw_logprobs`` by default: before temperature, top-k and top-p, so compare them with
    ``temperature=1``; a server started with ``--logprobs-mode processed_logprobs``
    returns them after temperature (and after top-k/top-p truncation, which this does not
    reproduce: with top_p < 1 neither matches exactly). Computed in float32: bf16
    (8 bits of mantissa) is too coarse for ratios that must start at exactly 1.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be positive to train on samples, got {temperature}")
    scaled = logits.float()
    if temperature != 1.0:
        scaled = scaled / temperature
    flat = scaled.reshape(-1, scaled.shape[-1])
    nll = F.cross_entropy(flat, targets.reshape(-1), reduction="none")
    return -nll.reshape(targets.shape)


def sequence_token_weight(
    aggregation: Aggregation, *, sequence_tokens: int, sequences: int, tokens: int
) -> float:
    """The weight of one trained token of a sequence with ``sequence_tokens`` of them, in
    a batch of ``sequences`` sequences and ``tokens`` trained tokens (the module's doc)."""
    if aggregation == "token-mean":
        return 1.0 / tokens
    if aggregation == "seq-mean-token-sum":
        return 1.0 / sequences
    return 1.0 / (sequences * sequence_tokens)


def aggregation_weights(mask: torch.Tensor, aggregation: Aggregation) -> torch.Tensor:
    """Per-token weights for a padded ``[sequences, length]`` mask, one sequence a row."""
    mask = mask.float()
    per_row = mask.sum(dim=-1, keepdim=True)
    sequences = int((per_row > 0).sum().item())
    tokens = int(mask.sum().item())
    if tokens == 0:
        return torch.zeros_like(mask)
    if aggregation == "token-mean":
        return mask / tokens
    if aggregation == "seq-mean-token-sum":
        return mask / sequences
    return mask / (sequences * per_row.clamp(min=1.0))


def staleness_weight(staleness: int, config: GRPOConfig) -> float:
    """How much a sample ``staleness`` weight versions behind the trained ones weighs.

    Within ``max_staleness`` (or with no bound) it weighs 1. Past it, ``stale="drop"``
    gives 0 (the sample leaves the batch) and ``stale="reweight"`` gives
    ``stale_decay ** (staleness - max_staleness)``: halved (by default) for every version
    past the bound. The importance ratio against the rollout logprobs already corrects
    the off-policy gap inside the clip range; the decay shrinks what the clip cannot.
    """
    bound = config.max_staleness
    if bound is None or staleness <= bound:
        return 1.0
    if config.stale == "drop":
        return 0.0
    return float(config.stale_decay ** (staleness - bound))


@dataclass(frozen=True, slots=True)
class LossMetrics:
    """Detached statistics over the trained tokens (0-dim tensors: no device sync)."""

    policy_loss: torch.Tensor
    kl_loss: torch.Tensor
    clip_fraction: torch.Tensor  # tokens whose clipped term was the one taken
    clip_low_fraction: torch.Tensor  # ratio below 1 - clip_low, advantage < 0
    clip_high_fraction: torch.Tensor  # ratio above 1 + clip_high, advantage > 0
    dual_clip_fraction: torch.Tensor
    approx_kl: torch.Tensor  # k3 of the rollout policy against the current one
    ratio_mean: torch.Tensor
    ratio_min: torch.Tensor
    ratio_max: torch.Tensor
    tokens: torch.Tensor
    # Trainer versus server on the tokens the trained weights sampled themselves
    # (``current``): |logprobs - old_logprobs| there is numerics only, never policy drift.
    gap_mean: torch.Tensor
    gap_max: torch.Tensor
    gap_tokens: torch.Tensor
    # The off-policy correction (1 and 0 without one): the mean importance weight it put
    # on a trained token, and the share of trained tokens it truncated (tis) or masked (mis).
    is_weight_mean: torch.Tensor
    is_cut_fraction: torch.Tensor

    def as_floats(self) -> dict[str, float]:
        return {name: float(getattr(self, name).item()) for name in self.__slots__}


def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_ratio_c: float | None = None,
    kl_coef: float = 0.0,
    ref_logprobs: torch.Tensor | None = None,
    aggregation: Aggregation = "token-mean",
    weights: torch.Tensor | None = None,
    current: torch.Tensor | None = None,
    correction: Correction = "none",
    correction_cap: float = 2.0,
    sequence_index: torch.Tensor | None = None,
) -> tuple[torch.Tensor, LossMetrics]:
    """The clipped surrogate of GRPO, plus ``kl_coef`` times the k3 KL to a reference.

    Per trained token, with ``r = exp(logprobs - old_logprobs)`` and advantage ``A``:
    ``max(-A * r, -A * clip(r, 1 - clip_low, 1 + clip_high))``; with ``clip_ratio_c``
    (dual clip), a negative-advantage token's loss is further capped at
    ``-A * clip_ratio_c``. ``old_logprobs`` are the rollout's logprobs.
    The KL term is ``exp(ref - logprobs) - (ref - logprobs) - 1`` (k3 of KL(policy || ref),
    non-negative); ``metrics.approx_kl`` is k3 of KL(rollout policy || current policy).

    ``weights`` are the per-token aggregation weights (zero off the mask), computed over
    a whole batch when this call sees only part of it; by default they come from
    ``aggregation`` over this call's rows, one sequence a row. The loss is
    ``sum(weights * token_loss)``.

    ``current`` marks the tokens sampled by the very weights being trained: on them
    ``metrics.gap_*`` measure how far the trainer's logprobs are from the server's (the
    forward pass the loss needs anyway, so the check costs nothing).

    ``correction`` (``"tis"`` or ``"mis"``, the module's doc) takes the clipped ratio
    against ``logprobs`` detached and weights each token by ``importance_weights``;
    ``sequence_index`` numbers each position's sequence for ``mis`` (-1: padding; by
    default one sequence a row).
    """
    mask = mask.float()
    if weights is None:
        weights = aggregation_weights(mask, aggregation)
    weights = weights * mask
    sampler_log_ratio = _log_ratio(logprobs.detach(), old_logprobs, mask)
    is_weight, is_cut = torch.ones_like(mask), torch.zeros_like(mask)
    anchor = old_logprobs
    if correction != "none":
        anchor = logprobs.detach()
        is_weight, is_cut = importance_weights(
            anchor, old_logprobs, mask, correction, correction_cap, sequence_index
        )
    log_ratio = _log_ratio(logprobs, anchor, mask)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    token_loss = torch.maximum(unclipped, clipped)
    dual = torch.zeros_like(mask, dtype=torch.bool)
    if clip_ratio_c is not None:
        cap = -advantages * clip_ratio_c
        dual = (advantages < 0) & (token_loss > cap)
        token_loss = torch.where(advantages < 0, torch.minimum(token_loss, cap), token_loss)
    policy_loss = (weights * is_weight * token_loss).sum()
    kl_loss = torch.zeros((), dtype=policy_loss.dtype, device=policy_loss.device)
    if kl_coef > 0:
        if ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs ref_logprobs")
        kl_loss = (weights * _k3(ref_logprobs - logprobs)).sum()
    loss = policy_loss + kl_coef * kl_loss
    with torch.no_grad():
        metrics = LossMetrics(
            policy_loss=policy_loss.detach(),
            kl_loss=kl_loss.detach(),
            clip_fraction=_masked_mean((clipped > unclipped).float(), mask),
            clip_low_fraction=_masked_mean(
                ((ratio < 1 - clip_low) & (advantages < 0)).float(), mask
            ),
            clip_high_fraction=_masked_mean(
                ((ratio > 1 + clip_high) & (advantages > 0)).float(), mask
            ),
            dual_clip_fraction=_masked_mean(dual.float(), mask),
            approx_kl=_masked_mean(_k3(sampler_log_ratio), mask),
            ratio_mean=_masked_mean(ratio, mask),
            ratio_min=_masked_extreme(ratio, mask, torch.min),
            ratio_max=_masked_extreme(ratio, mask, torch.max),
            tokens=mask.sum(),
            **_gap(sampler_log_ratio, mask if current is None else mask * current.float()),
            is_weight_mean=_masked_mean(is_weight, mask),
            is_cut_fraction=_masked_mean(is_cut, mask),
        )
    return loss, metrics


def importance_weights(
    trainer_logprobs: torch.Tensor,
    sampler_logprobs: torch.Tensor,
    mask: torch.Tensor,
    correction: Correction,
    cap: float,
    sequence_index: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token, the correction's importance weight (0 off the mask) and 1.0 where it
    truncated (``tis``) or masked (``mis``) the token. ``sequence_index`` as in
    ``grpo_loss``."""
    mask = mask.float()
    log_ratio = _log_ratio(trainer_logprobs, sampler_logprobs, mask)
    if correction == "tis":
        ratio = torch.exp(log_ratio)
        return ratio.clamp(max=cap) * mask, (ratio > cap).float() * mask
    if correction != "mis":
        raise ValueError(f"no importance weights for correction {correction!r}")
    if sequence_index is None:
        rows = torch.arange(mask.shape[0], device=mask.device)
        sequence_index = rows.unsqueeze(-1).expand(mask.shape)
    index = sequence_index.reshape(-1).long()
    on = (index >= 0) & (mask.reshape(-1) > 0)
    sums = torch.zeros(int(index.max().item()) + 1 if index.numel() else 0, device=mask.device)
    sums.index_add_(0, index[on], log_ratio.reshape(-1)[on])
    # A sequence's ratio, at each of its positions; the clamp keeps a long one finite.
    ratio = torch.exp(sums.clamp(-_RATIO_CLAMP, _RATIO_CLAMP))[index.clamp(min=0)]
    ratio = ratio.reshape(mask.shape)
    kept = ratio <= cap
    return torch.where(kept, ratio, 0.0) * mask, (~kept).float() * mask


def _log_ratio(logprobs: torch.Tensor, reference: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``logprobs - reference`` on the mask, 0 off it, whatever the inputs hold there (an
    overflowing ratio times a zero weight would be NaN); clamped, so one wild token stays
    finite."""
    return torch.where(mask > 0, logprobs - reference, 0.0).clamp(-_RATIO_CLAMP, _RATIO_CLAMP)


def _gap(log_ratio: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    gap = log_ratio.abs()
    return {
        "gap_mean": _masked_mean(gap, mask),
        "gap_max": _masked_extreme(gap, mask, torch.max, empty=0.0),
        "gap_tokens": mask.sum(),
    }


def _k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """``exp(x) - x - 1`` of a log-ratio ``x = log p - log q`` over samples of ``q``: an
    unbiased, non-negative estimate of KL(q || p)."""
    log_ratio = log_ratio.clamp(-_KL_CLAMP, _KL_CLAMP)
    return torch.exp(log_ratio) - log_ratio - 1.0


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


def _masked_extreme(
    values: torch.Tensor,
    mask: torch.Tensor,
    extreme: Callable[[torch.Tensor], torch.Tensor],
    empty: float = 1.0,
) -> torch.Tensor:
    trained = values[mask > 0]
    return extreme(trained) if trained.numel() else torch.full((), empty, dtype=values.dtype)
