"""Typed ``[train]`` and ``[grpo]`` sections: how records become batches, and the loss."""

from __future__ import annotations

from pydantic import Field, NonNegativeInt, PositiveFloat, PositiveInt

from libra.config import Section
from libra.trainer._kinds import Aggregation, BatchLayout, Correction, FailureRule, StaleRule


class GRPOConfig(Section):
    """Group-relative advantages and the clipped surrogate loss (see ``libra.trainer._loss``)."""

    scale_by_std: bool = Field(
        True, description="divide advantages by the group's std; False: Dr.GRPO, mean only"
    )
    epsilon: PositiveFloat = Field(1e-6, description="added to the std before dividing")
    clip_low: float = Field(0.2, ge=0, lt=1, description="the ratio's floor is 1 - clip_low")
    clip_high: float = Field(
        0.2, ge=0, description="the ratio's ceiling is 1 + clip_high (clip-higher: above low)"
    )
    clip_ratio_c: float | None = Field(
        None,
        gt=1,
        description="dual clip: for negative advantages, the loss is at most "
        "-advantage * clip_ratio_c; None: off",
    )
    kl_coef: float = Field(
        0.0, ge=0, description="weight of the k3 KL to a reference model; 0: no reference"
    )
    aggregation: Aggregation = Field(
        "token-mean",
        description="token-mean: every trained token of the batch counts the same; "
        "seq-mean-token-sum: sum per sequence, mean over sequences; "
        "seq-mean-token-mean: mean per sequence, then mean over sequences",
    )
    max_staleness: NonNegativeInt | None = Field(
        None,
        description="weight versions a sample may lag behind the trained weights; None: no bound",
    )
    stale: StaleRule = Field(
        "drop", description="samples past max_staleness: dropped, or reweighted"
    )
    stale_decay: float = Field(
        0.5,
        gt=0,
        le=1,
        description="reweight: a sample k versions past the bound weighs stale_decay ** k",
    )
    correction: Correction = Field(
        "none",
        description="off-policy correction between the sampler's logprobs and the trainer's "
        "(see libra.trainer._loss): none: the clipped ratio is taken against the sampler's "
        "own logprobs; tis: against the trainer's, each token weighted by its importance "
        "ratio truncated at correction_cap; mis: against the trainer's, each sequence "
        "weighted by its importance ratio, or masked where that ratio is above correction_cap",
    )
    correction_cap: float = Field(
        2.0, gt=1, description="tis: a token's weight at most; mis: a sequence's, above: masked"
    )


class TrainConfig(Section):
    """How a step's records are laid out in micro-batches (see ``libra.trainer._batch``)."""

    micro_batch_tokens: PositiveInt = Field(
        2048,
        description="token budget of one micro-batch, padding included; the fp32 logits "
        "alone take 4 bytes x vocabulary per token (SmolLM2: 0.4 GB per 2048 tokens), "
        "so raise it on GPUs, lower it on small CPU machines",
    )
    layout: BatchLayout = Field(
        "packed",
        description="packed: one row per micro-batch, positions restart at each sample; "
        "padded: one right-padded row per sample, with an attention mask",
    )
    pad_token_id: NonNegativeInt = Field(0, description="fills the padding (never trained)")
    failures: FailureRule = Field(
        "exclude",
        description="records that failed (status 'failed': a server, sandbox or env fault, "
        "never the policy's doing) never train and never count in their group's statistics; "
        "exclude: the group goes on without them; retry: the trajectory is run again, up to "
        "max_retries times, before it is excluded. What the policy caused (its code crashing "
        "or timing out in a tool, a turn cut at the token limit) is scored as usual",
    )
    max_retries: NonNegativeInt = Field(
        2, description="failures = 'retry': runs of one trajectory after its first"
    )
