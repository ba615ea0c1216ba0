"""Training batches from finished trajectories: grouped, scored, and laid out in tokens.

The tokens are the record's own ``token_ids``, ``loss_mask`` and ``logprobs``, never
re-tokenized. Which records train, and how:

- **failed** records carry no reward (a fault is never the model's failure): they leave
  the batch and do not count in their group's statistics (with ``train.failures =
  "retry"`` the loop has run them again first: what reaches here failed every time).
- **Group statistics** (mean and std of the reward, the unbiased std as peers use) are
  taken over the group's *scored* samples: completed or truncated, with a reward.
  A group with fewer than 2 of them, or whose rewards are all equal, gives every sample
  an advantage of 0: no policy signal, so its samples leave the batch (keeping them would
  only dilute ``token-mean`` and cost compute).
- **Tokens that are not ``exact``** leave the batch: ``drift`` records hold ids only up to
  the drift while the reward covers the whole episode, and ``none`` records hold no ids.
  Their reward still counts in the group's statistics: it is a genuine outcome of the
  policy for that prompt, and the baseline is better for it.
- **Staleness**: a sample's version is the oldest weight version that sampled one of its
  tokens; ``current_version - version`` versions behind the trained weights it weighs
  ``staleness_weight`` (0: dropped). A stale sample still counts in its group's
  statistics, as the inexact ones do.
- Samples with no sampled token leave the batch.

Each dropped sample is counted under its reason in ``Batch.dropped``.

**Layout.** A sample is one sequence of ids, or several: an episode in pieces (its
record's ``piece_starts``: a client that edited its history) gives one sequence per
piece, each with the sample's advantage and loss weight. A sequence of ``n`` ids gives
``n - 1`` positions: inputs ``ids[:-1]``, targets ``ids[1:]``, and the mask and rollout
logprobs of the targets. Micro-batches are filled first-fit in decreasing length under
``micro_batch_tokens`` (padding counted); a sequence longer than the budget gets a
micro-batch of its own. ``packed``: one row, sequences end to end, ``position_ids``
restarting at 0 for each and no attention mask, which transformers (5.x) reads as
block-diagonal causal attention (tested against padding; ``cu_seqlens`` is there for
varlen kernels). ``padded``: one row per sequence, right-padded, with an
``attention_mask``. For data parallelism the micro-batch count is a
multiple of the ranks, each rank taking an equal count (``Batch.for_rank``); the loss
weights stay those of the whole batch.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from libra.engine import Status, TokenSource, TrajectoryRecord
from libra.trainer._config import GRPOConfig, TrainConfig
from libra.trainer._kinds import BatchLayout
from libra.trainer._loss import LossMetrics, grpo_loss, sequence_token_weight, staleness_weight


@dataclass(frozen=True, slots=True)
class Sample:
    """What the trainer takes from one record."""

    id: str
    group: str
    status: Status
    tokens: TokenSource
    reward: float | None
    token_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]
    logprobs: tuple[float, ...]  # 0.0 where the mask is 0
    weight_version: int | None  # the oldest that sampled one of its tokens; None: none did
    spans: tuple[tuple[int, int, int], ...] = ()  # (start, end, version): who sampled what
    starts: tuple[int, ...] = (0,)  # where each of its sequences starts: its pieces

    @classmethod
    def from_record(cls, record: TrajectoryRecord, *, group: str | None = None) -> Sample:
        """``group`` defaults to the record's group: its task at its step."""
        versions = [span.version for span in record.weight_versions if span.end > span.start]
        return cls(
            id=record.id,
            group=record.group_id if group is None else group,
            status=record.status,
            tokens=record.tokens,
            reward=record.reward,
            token_ids=tuple(record.token_ids),
            loss_mask=tuple(record.loss_mask),
            logprobs=tuple(0.0 if p is None else p for p in record.logprobs),
            weight_version=min(versions, default=None),
            spans=tuple((span.start, span.end, span.version) for span in record.weight_versions),
            starts=(0, *record.piece_starts),
        )

    @property
    def scored(self) -> bool:
        return self.status != "failed" and self.reward is not None

    def sequences(self) -> list[tuple[int, int]]:
        """``(start, end)`` of each of its sequences that has a position."""
        bounds = zip(self.starts, (*self.starts[1:], len(self.token_ids)), strict=True)
        return [(start, end) for start, end in bounds if end - start > 1]

    @property
    def positions(self) -> int:
        """Input positions: in each sequence, every id but the last is an input, every id
        but the first a target."""
        return sum(end - start - 1 for start, end in self.sequences())

    @property
    def trained_tokens(self) -> int:
        return sum(sum(self.loss_mask[start + 1 : end]) for start, end in self.sequences())

    def sampled_by(self, version: int) -> list[float]:
        """Per id: 1.0 where weights of ``version`` sampled it, else 0.0."""
        marks = [0.0] * len(self.token_ids)
        for start, end, sampled in self.spans:
            if sampled == version:
                marks[start:end] = [1.0] * (end - start)
        return marks


def group_advantages(
    rewards: Sequence[float], *, scale_by_std: bool = True, epsilon: float = 1e-6
) -> list[float]:
    """``(r - mean) / (std + epsilon)`` with the unbiased std, or ``r - mean``
    (Dr.GRPO); all zeros for fewer than 2 rewards or rewards that are all equal."""
    if len(rewards) < 2 or min(rewards) == max(rewards):
        return [0.0] * len(rewards)
    mean = statistics.fmean(rewards)
    scale = statistics.stdev(rewards) + epsilon if scale_by_std else 1.0
    return [(reward - mean) / scale for reward in rewards]


@dataclass(frozen=True, slots=True)
class MicroBatch:
    """One forward/backward's worth of tokens, ``[rows, length]`` each.

    The weighted sums ``(loss_weights * token_loss).sum()`` of a batch's micro-batches add
    up to the batch's loss (the aggregation weights are computed over the whole batch), so
    gradients accumulate by plain addition. A trainer that averages instead (over its
    micro-batches, or over data-parallel ranks in the gradient reduction) must multiply
    each micro-batch's loss by what it divides by, or the aggregation changes.
    """

    layout: BatchLayout
    input_ids: torch.Tensor  # long
    targets: torch.Tensor  # long: the next id; padding where nothing follows
    position_ids: torch.Tensor  # long: restarts at 0 for each sample
    attention_mask: torch.Tensor | None  # padded: 1 on ids, 0 on padding; packed: None
    loss_mask: torch.Tensor  # float: 1 where the target was sampled by the model
    old_logprobs: torch.Tensor  # float: the rollout's logprob of each trained target
    advantages: torch.Tensor  # float: the sample's advantage on each of its positions
    loss_weights: torch.Tensor  # float: aggregation weight x staleness weight, 0 off mask
    current: torch.Tensor  # float: 1 where the weights being trained sampled the target
    sample_index: torch.Tensor  # long: the position's sequence in ``sample_ids``; -1: pad
    cu_seqlens: torch.Tensor  # int32: packed: sequence boundaries in the row; padded: rows
    sample_ids: tuple[str, ...]  # each sequence's sample (a sample in pieces: repeated)
    weight_versions: torch.Tensor  # long, per sequence: its sample's

    @property
    def positions(self) -> int:
        return int(self.input_ids.numel())

    def loss(
        self,
        logprobs: torch.Tensor,
        grpo: GRPOConfig,
        *,
        ref_logprobs: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, LossMetrics]:
        """``grpo_loss`` of the current policy's ``logprobs`` of ``targets``, weighted as
        the whole batch aggregates."""
        return grpo_loss(
            logprobs,
            self.old_logprobs,
            self.advantages,
            self.loss_mask,
            clip_low=grpo.clip_low,
            clip_high=grpo.clip_high,
            clip_ratio_c=grpo.clip_ratio_c,
            kl_coef=grpo.kl_coef,
            ref_logprobs=ref_logprobs,
            weights=self.loss_weights,
            current=self.current,
            correction=grpo.correction,
            correction_cap=grpo.correction_cap,
            sequence_index=self.sample_index,
        )

    def to(self, device: torch.device | str) -> MicroBatch:
        """The same micro-batch with every tensor on ``device``."""
        moved = {
            f.name: value.to(device)
            for f in dataclasses.fields(self)
            if isinstance(value := getattr(self, f.name), torch.Tensor)
        }
        return dataclasses.replace(self, **moved)


@dataclass(frozen=True, slots=True)
class Batch:
    """A step's trained samples, their advantages, and the micro-batches that hold them."""

    micro_batches: list[MicroBatch]
    samples: list[Sample]
    advantages: dict[str, float]  # every scored sample's, trained or not
    dropped: Counter[str] = field(default_factory=Counter)
    ranks: int = 1

    @property
    def trained_tokens(self) -> int:
        return sum(sample.trained_tokens for sample in self.samples)

    @property
    def positions(self) -> int:
        """The inputs the forward and backward passes run over: what a step costs."""
        return sum(sample.positions for sample in self.samples)

    def for_rank(self, rank: int) -> list[MicroBatch]:
        """Data-parallel rank ``rank``'s share: as many micro-batches as every other rank
        (FSDP's collectives hang otherwise), longest first to the rank with the fewest
        positions so far."""
        if not 0 <= rank < self.ranks:
            raise ValueError(f"rank {rank} of a batch planned for {self.ranks} ranks")
        return [
            self.micro_batches[i]
            for i in _deal([m.positions for m in self.micro_batches], self.ranks)[rank]
        ]


def build_batch(
    samples: Iterable[Sample],
    *,
    current_version: int,
    grpo: GRPOConfig | None = None,
    train: TrainConfig | None = None,
    ranks: int = 1,
) -> Batch:
    """Group, score and lay out ``samples`` for weights at ``current_version``, in a
    multiple of ``ranks`` micro-batches (see ``Batch.for_rank``)."""
    grpo, train = grpo or GRPOConfig(), train or TrainConfig()
    samples = list(samples)
    if len({sample.id for sample in samples}) != len(samples):
        raise ValueError("two samples share an id: a batch holds each trajectory once")
    groups = _scored_groups(samples)
    advantages = _advantages(groups, grpo)
    dropped: Counter[str] = Counter()
    kept: list[tuple[Sample, float]] = []
    for sample in samples:
        reason, weight = _drop_reason(sample, groups, current_version, grpo)
        if reason:
            dropped[reason] += 1
        else:
            kept.append((sample, weight))
    weights = _token_weights(kept, grpo)
    sequences = [
        _Sequence(sample, weight, advantages[sample.id], start, end)
        for (sample, _), weight in zip(kept, weights, strict=True)
        for start, end in sample.sequences()
    ]
    plan = plan_micro_batches([seq.positions for seq in sequences], train, ranks=ranks)
    micro_batches = [
        _micro_batch([sequences[i] for i in rows], train, current_version) for rows in plan
    ]
    return Batch(micro_batches, [sample for sample, _ in kept], advantages, dropped, ranks)


def _scored_groups(samples: list[Sample]) -> dict[str, list[Sample]]:
    groups: defaultdict[str, list[Sample]] = defaultdict(list)
    for sample in samples:
        if sample.scored:
            groups[sample.group].append(sample)
    return groups


def _advantages(groups: dict[str, list[Sample]], grpo: GRPOConfig) -> dict[str, float]:
    advantages: dict[str, float] = {}
    for members in groups.values():
        rewards = [float(sample.reward or 0.0) for sample in members]
        values = group_advantages(rewards, scale_by_std=grpo.scale_by_std, epsilon=grpo.epsilon)
        advantages.update(zip((sample.id for sample in members), values, strict=True))
    return advantages


def _uninformative(members: list[Sample]) -> str | None:
    """Why a group's scored samples carry no policy signal (None: they do)."""
    if len(members) < 2:
        return "lone sample"
    rewards = {sample.reward for sample in members}
    return "equal rewards" if len(rewards) == 1 else None


def _drop_reason(
    sample: Sample, groups: dict[str, list[Sample]], current_version: int, grpo: GRPOConfig
) -> tuple[str | None, float]:
    """Why ``sample`` leaves the batch (None: it stays), and its staleness weight."""
    if sample.status == "failed":
        return "failed", 0.0
    if sample.reward is None:
        return "unscored", 0.0
    if reason := _uninformative(groups[sample.group]):
        return reason, 0.0
    if sample.tokens != "exact":
        return f"tokens {sample.tokens}", 0.0
    if sample.weight_version is None or sample.trained_tokens == 0:
        return "nothing sampled", 0.0
    weight = staleness_weight(current_version - sample.weight_version, grpo)
    return ("stale", 0.0) if weight == 0.0 else (None, weight)


def _token_weights(kept: list[tuple[Sample, float]], grpo: GRPOConfig) -> list[float]:
    """Each kept sample's per-token loss weight: aggregation over the whole batch times
    its staleness weight."""
    tokens = sum(sample.trained_tokens for sample, _ in kept)
    return [
        staleness
        * sequence_token_weight(
            grpo.aggregation,
            sequence_tokens=sample.trained_tokens,
            sequences=len(kept),
            tokens=tokens,
        )
        for sample, staleness in kept
    ]


def plan_micro_batches(
    lengths: Sequence[int], train: TrainConfig, *, ranks: int = 1
) -> list[list[int]]:
    """Indices of ``lengths`` per micro-batch: first fit, longest first, under the budget
    (a padded micro-batch costs its longest sample times its sample count). Then, until
    the count is a multiple of ``ranks``, the micro-batch with the most samples is cut in
    two (its samples dealt alternately, longest first)."""
    budget = train.micro_batch_tokens
    order = sorted(range(len(lengths)), key=lambda i: lengths[i], reverse=True)
    plan: list[list[int]] = []
    for index in order:
        for rows in plan:
            if _cost([*rows, index], lengths, train.layout) <= budget:
                rows.append(index)
                break
        else:
            plan.append([index])
    while len(plan) % ranks:
        fullest = max(plan, key=len)
        if len(fullest) < 2:
            raise ValueError(f"{len(lengths)} samples cannot give {ranks} ranks equal shares")
        plan.remove(fullest)
        plan += [fullest[::2], fullest[1::2]]
    return plan


def _deal(sizes: Sequence[int], ranks: int) -> list[list[int]]:
    """Indices of ``sizes`` per rank, the same count each: largest first, each to the
    rank with the least so far among those not yet full."""
    share = len(sizes) // ranks
    dealt: list[list[int]] = [[] for _ in range(ranks)]
    loads = [0] * ranks
    for index in sorted(range(len(sizes)), key=lambda i: sizes[i], reverse=True):
        rank = min((r for r in range(ranks) if len(dealt[r]) < share), key=lambda r: loads[r])
        dealt[rank].append(index)
        loads[rank] += sizes[index]
    return dealt


def _cost(rows: list[int], lengths: Sequence[int], layout: BatchLayout) -> int:
    if layout == "packed":
        return sum(lengths[i] for i in rows)
    return max(lengths[i] for i in rows) * len(rows)


@dataclass(frozen=True, slots=True)
class _Sequence:
    """One sequence of a kept sample: ids ``[start, end)``, a row of the layout."""

    sample: Sample
    weight: float  # the sample's per-token loss weight
    advantage: float
    start: int
    end: int

    @property
    def positions(self) -> int:
        return self.end - self.start - 1


def _micro_batch(
    sequences: list[_Sequence], train: TrainConfig, current_version: int
) -> MicroBatch:
    columns = [_columns(seq, i, current_version) for i, seq in enumerate(sequences)]
    lengths = [seq.positions for seq in sequences]
    if train.layout == "packed":
        stacked = {name: torch.cat([c[name] for c in columns]).unsqueeze(0) for name in columns[0]}
        attention_mask = None
    else:
        stacked = {name: _pad_rows([c[name] for c in columns], name, train) for name in columns[0]}
        attention_mask = _pad_rows(
            [torch.ones(n, dtype=torch.long) for n in lengths], "mask", train
        )
    return MicroBatch(
        layout=train.layout,
        input_ids=stacked["input_ids"],
        targets=stacked["targets"],
        position_ids=stacked["position_ids"],
        attention_mask=attention_mask,
        loss_mask=stacked["loss_mask"],
        old_logprobs=stacked["old_logprobs"],
        advantages=stacked["advantages"],
        loss_weights=stacked["loss_weights"],
        current=stacked["current"],
        sample_index=stacked["sample_index"],
        cu_seqlens=torch.tensor([0, *_running_sum(lengths)], dtype=torch.int32),
        sample_ids=tuple(seq.sample.id for seq in sequences),
        weight_versions=torch.tensor(
            [seq.sample.weight_version or 0 for seq in sequences], dtype=torch.long
        ),
    )


def _columns(seq: _Sequence, index: int, current_version: int) -> dict[str, torch.Tensor]:
    """A sequence's positions: inputs, next-id targets, and what is known of each target."""
    sample, start, end = seq.sample, seq.start, seq.end
    ids = torch.tensor(sample.token_ids[start:end], dtype=torch.long)
    mask = torch.tensor(sample.loss_mask[start + 1 : end], dtype=torch.float32)
    n = seq.positions
    return {
        "input_ids": ids[:-1],
        "targets": ids[1:],
        "position_ids": torch.arange(n, dtype=torch.long),
        "loss_mask": mask,
        "old_logprobs": torch.tensor(sample.logprobs[start + 1 : end], dtype=torch.float32) * mask,
        "advantages": torch.full((n,), seq.advantage, dtype=torch.float32),
        "loss_weights": mask * seq.weight,
        "current": torch.tensor(sample.sampled_by(current_version)[start + 1 : end]) * mask,
        "sample_index": torch.full((n,), index, dtype=torch.long),
    }


def _pad_value(name: str, train: TrainConfig) -> float:
    """What padding holds, per column: it is never trained and never attended to."""
    if name in ("input_ids", "targets"):
        return train.pad_token_id
    return -1 if name == "sample_index" else 0


def _pad_rows(rows: list[torch.Tensor], name: str, train: TrainConfig) -> torch.Tensor:
    return torch.nn.utils.rnn.pad_sequence(
        rows, batch_first=True, padding_value=_pad_value(name, train)
    )


def _running_sum(values: Iterable[int]) -> list[int]:
    total, sums = 0, []
    for value in values:
        total += value
        sums.append(total)
    return sums
