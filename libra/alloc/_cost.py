"""Cost models the planner prices plans with: rollout by the roofline, training by FLOPs.

Both start from a datasheet prior and are fitted from what the run measures. The fit keeps
one multiplicative correction per term of the prior (rollout: prefill, decode bytes, decode
compute; training: compute, FSDP communication, per-step overhead) and solves for them by
least squares on relative error (each observation's row divided by its measured seconds,
so a long call weighs no more than a short one), with a weak ridge pull towards 1 (the
prior) so a term the observations do not yet separate stays at its prior. Observations are
kept in a sliding window, so the fit follows drift.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from pydantic import Field, PositiveFloat, PositiveInt

from libra.alloc._protocol import CallTiming, Demand, StepTiming
from libra.config import Section
from libra.fleet import Corrections, Gpu, Roofline, StepCost

# Datasheet figures (dense bf16, HBM bandwidth, 80 GB SXM parts; H200 carries 141 GB).
A100 = Gpu(name="A100", memory_bytes=80e9, hbm_bytes_per_s=2.0e12, dense_bf16_flops=312e12)
#: The A800 is an A100 with a slower NVLink (400 GB/s instead of 600): the same roofline.
A800 = Gpu(name="A800", memory_bytes=80e9, hbm_bytes_per_s=2.0e12, dense_bf16_flops=312e12)
H100 = Gpu(name="H100", memory_bytes=80e9, hbm_bytes_per_s=3.35e12, dense_bf16_flops=990e12)
H200 = Gpu(name="H200", memory_bytes=141e9, hbm_bytes_per_s=4.8e12, dense_bf16_flops=990e12)
PRESETS: dict[str, Gpu] = {gpu.name: gpu for gpu in (A100, A800, H100, H200)}
#: NVLink bytes per second per GPU, where the leads give it.
NVLINK_BYTES_PER_S: dict[str, float] = {"A100": 600e9, "A800": 400e9}


# ------------------------------------------------------------------------------ rollout


@dataclass(frozen=True, slots=True)
class Request:
    """One trajectory as rollout sees it: tokens to prefill (uncached) and to decode."""

    prefill_tokens: int
    output_tokens: int
    context_tokens: int
    #: Trajectories this one stands for (placement places them together).
    copies: float = 1.0
    #: Seconds its tools take between its turns (the instance serves others meanwhile).
    tool_s: float = 0.0
    #: The mean context its tokens are decoded at (0: its context less half its output,
    #: as if every prompt token came before the first sampled one).
    decode_context: float = 0.0

    @property
    def mid_decode_context(self) -> float:
        return self.decode_context or self.context_tokens - self.output_tokens / 2


def requests_of(workload: Demand, limit: int | None = None) -> list[Request]:
    """The workload's trajectories: its length samples, as many as its count (fewer
    samples are repeated; more, from several recent steps pooled, give their evenly
    spaced quantiles, so every step counts); past ``limit``, that many quantiles, each
    standing for its share."""
    tools = workload.tool_s or (0.0,) * len(workload.output_tokens)
    decoded = workload.decode_context_tokens or (0.0,) * len(workload.output_tokens)
    samples = [
        Request(max(0, ctx - out), out, max(ctx, out), tool_s=tool, decode_context=at)
        for out, ctx, tool, at in zip(
            workload.output_tokens, workload.context_tokens, tools, decoded, strict=True
        )
    ]
    if not samples:
        return []
    every = _quantiles(samples, workload.trajectories)
    if limit is None or len(every) <= limit:
        return every
    copies = len(every) / limit
    return [replace(r, copies=copies) for r in _quantiles(every, limit)]


def _quantiles(requests: list[Request], count: int) -> list[Request]:
    """``count`` requests standing for ``requests``: repeated when fewer, else evenly
    spaced quantiles by size (the largest always among them: it bounds the makespan)."""
    if len(requests) <= count:
        return [requests[i % len(requests)] for i in range(count)]
    ranked = sorted(requests, key=_size)
    spacing = len(ranked) / count
    return [ranked[int((i + 0.5) * spacing)] for i in range(count - 1)] + [ranked[-1]]


@dataclass(slots=True)
class _Instance:
    """What has been placed on one instance, in the aggregates its time depends on."""

    tp: int
    batch_cap: int
    count: float = 0
    prefill_tokens: float = 0
    output_tokens: float = 0
    longest_output: int = 0
    ctx_weighted: float = 0.0
    longest: Request | None = None  # the request with the longest output

    def with_request(self, request: Request) -> _Instance:
        longest = request if request.output_tokens > self.longest_output else self.longest
        return _Instance(
            self.tp,
            self.batch_cap,
            self.count + request.copies,
            self.prefill_tokens + request.prefill_tokens * request.copies,
            self.output_tokens + request.output_tokens * request.copies,
            max(self.longest_output, request.output_tokens),
            self.ctx_weighted + request.mid_decode_context * request.output_tokens * request.copies,
            longest,
        )


#: How the routing treats the longest trajectory, which bounds the rollout from below:
#: ``alone`` when it gets a lane of its own (C-MLFQ demotes the long ones to instances
#: where they run nearly alone), ``in_batch`` when it shares full batches with everyone
#: and each of its turns goes wherever a call slot frees first (least-loaded spreads
#: calls without regard to length, so a mixed layout's smallest instance takes its share
#: of the longest trajectory's turns too).
LongestDecodes = Literal["alone", "in_batch"]


class RolloutCost:
    """Seconds rollout takes on a layout of instances, from the roofline plus fitted
    corrections per TP size (terms: prefill, decode bytes, decode compute).

    A decode step of ``B`` sequences is priced as the roofline's ``StepCost``: the bytes
    term (weights, KV, overhead, all-reduce) and the compute term (per sequence) are
    corrected separately, since bandwidth and MFU are off by different amounts.

    The fit's ``window`` of calls must span a whole step: calls end in the step's order,
    full batches first and the long tail last, so a window of the last few dozen fits
    the tail's small batches alone and misprices the full ones.
    """

    def __init__(
        self,
        roofline: Roofline,
        *,
        max_num_seqs: int = 256,
        window: int = 1024,
        placement_samples: int | None = 128,
        longest_decodes: LongestDecodes = "alone",
    ) -> None:
        self.roofline = roofline
        self.longest_decodes = longest_decodes
        self.max_num_seqs = max_num_seqs
        self.placement_samples = placement_samples
        self._window = window
        self._fits: dict[int, Corrections] = {}
        self._pooled = Corrections(3, window=window)
        self._step_costs: dict[int, StepCost] = {}
        # (instance, calls in flight on it) per recent call: how many calls the fleet
        # holds at once, whatever its layout.
        self._in_flight: deque[tuple[str, int]] = deque(maxlen=window)

    def _requests(self, workload: Demand) -> list[Request]:
        return requests_of(workload, self.placement_samples)

    def step_cost(self, tp: int) -> StepCost:
        cost = self._step_costs.get(tp)
        if cost is None:
            cost = self._step_costs[tp] = self.roofline.step_cost(tp)
        return cost

    def weights_fit(self, tp: int) -> bool:
        """The weights and room for at least one long context fit on ``tp`` GPUs."""
        return self.roofline.kv_capacity_tokens(tp) > 0

    def corrections(self, tp: int) -> Corrections:
        """The fit for ``tp``; one pooled over every TP until ``tp`` has observations."""
        fit = self._fits.get(tp)
        return fit if fit is not None and fit.observations else self._pooled

    def call_terms(self, tp: int, timing: CallTiming) -> tuple[float, float, float]:
        """The prior's terms of one call: its prefill, and its decode steps shared with
        ``concurrent`` sequences of about its context."""
        cost = self.step_cost(tp)
        batch = max(1, timing.concurrent)
        context = batch * (timing.prompt_tokens + timing.new_tokens / 2)
        steps = timing.new_tokens
        return _terms(cost, timing.prompt_tokens - timing.cached_tokens, steps, batch, context)

    def observe(self, timing: CallTiming) -> None:
        terms = self.call_terms(timing.tp, timing)
        fit = self._fits.setdefault(timing.tp, Corrections(3, window=self._window))
        fit.add(terms, timing.seconds)
        self._pooled.add(terms, timing.seconds)
        self._in_flight.append((timing.instance, timing.concurrent))

    def in_flight(self, workload: Demand) -> float:
        """Calls the fleet holds at once: the recent calls' in-flight counts, averaged
        per instance and summed; before any call, every trajectory (none in its tools)."""
        per_instance: dict[str, list[int]] = {}
        for instance, concurrent in self._in_flight:
            per_instance.setdefault(instance, []).append(concurrent)
        if not per_instance:
            return float(workload.trajectories)
        return sum(sum(counts) / len(counts) for counts in per_instance.values())

    def predict_call(self, timing: CallTiming) -> float:
        return self.corrections(timing.tp).apply(self.call_terms(timing.tp, timing))

    def batch_cap(self, tp: int, workload: Demand) -> int:
        """Sequences an instance runs at once: ``max_num_seqs``, or fewer when the KV
        cache cannot hold that many of the workload's mean context."""
        contexts = workload.context_tokens or (1,)
        mean_context = max(1.0, sum(contexts) / len(contexts))
        by_kv = int(self.roofline.kv_capacity_tokens(tp) / mean_context)
        return max(1, min(self.max_num_seqs, by_kv))

    def instance_seconds(self, instance: _Instance) -> float:
        if instance.count == 0:
            return 0.0
        batched, batch, context = self._batched(instance)
        return max(batched, self._chain_seconds(instance.tp, instance.longest, batch, context))

    def _batched(self, instance: _Instance, span: int = 0) -> tuple[float, float, float]:
        """Seconds the instance takes for its placed work in full batches, with that
        batch's mean size and context, spread over at least ``span`` decode steps."""
        steps = max(
            span, instance.longest_output, math.ceil(instance.output_tokens / instance.batch_cap)
        )
        batch = instance.output_tokens / max(1, steps)
        context = batch * instance.ctx_weighted / max(1, instance.output_tokens)
        cost = self.step_cost(instance.tp)
        corrections = self.corrections(instance.tp)
        batched = corrections.apply(_terms(cost, instance.prefill_tokens, steps, batch, context))
        return batched, batch, context

    def _chain_seconds(
        self, tp: int, request: Request | None, batch: float, context: float
    ) -> float:
        """The longest trajectory end to end: its turns one after another, each waiting
        for its tools (the instance serves the others meanwhile), each decode step shared
        with the instance's mean ``batch`` of ``context`` tokens, or alone (see
        :data:`LongestDecodes`)."""
        if request is None:
            return 0.0
        if self.longest_decodes == "alone":
            batch, context = 1.0, request.mid_decode_context
        return self._decode_seconds(tp, request, batch, context) + request.tool_s

    def _decode_seconds(self, tp: int, request: Request, batch: float, context: float) -> float:
        """``request``'s prefill and decode steps, each shared with ``batch`` sequences of
        ``context`` tokens."""
        cost = self.step_cost(tp)
        terms = _terms(cost, request.prefill_tokens, request.output_tokens, batch, context)
        return self.corrections(tp).apply(terms)

    def _spread_chain_seconds(
        self, instances: Sequence[_Instance], waits: Sequence[float]
    ) -> float:
        """The longest trajectory end to end when each of its turns goes wherever a call
        slot frees first (least-loaded): a turn lands on an instance as often as any call
        does, so its decode is priced on every instance, weighed by the instance's share
        of the calls, in the instance's mean batch over the longest one's steps, and
        slowed by ``waits`` where the instance holds more calls than it runs (they take
        turns: each advances at the running share)."""
        placed = [(i, wait) for i, wait in zip(instances, waits, strict=True) if i.count]
        longest = max((i.longest for i, _ in placed if i.longest), key=_size, default=None)
        if longest is None:
            return 0.0
        total = sum(instance.count for instance, _ in placed)
        seconds = 0.0
        for instance, wait in placed:
            # The instance's work shares the longest one's steps, which outlast it.
            _, batch, context = self._batched(instance, span=longest.output_tokens)
            if instance.longest is not longest:  # the longest one's own turns join it
                batch, context = batch + 1, context + longest.mid_decode_context
            decode = self._decode_seconds(instance.tp, longest, batch, context)
            seconds += instance.count / total * decode * wait
        return seconds + longest.tool_s

    def longest_alone(self, tp: int, workload: Demand) -> float:
        """The longest request alone on an instance of ``tp``: no layout beats it."""
        requests = requests_of(workload)
        if not requests:
            return 0.0
        longest = max(requests, key=_size)
        return self.instance_seconds(
            _Instance(tp, self.batch_cap(tp, workload)).with_request(longest)
        )

    def makespan(self, tps: Sequence[int], workload: Demand) -> float:
        """Requests placed longest-first, each on the instance it finishes earliest on;
        the makespan is the slowest instance's time.

        Under least-loaded (``in_batch``) every instance holds about as many calls as
        any other, whatever its size: a large instance runs no more than its share of
        the calls in flight (:meth:`in_flight`), and a small one whose KV cache holds
        fewer runs what it holds while the rest wait their turn."""
        if not tps:
            return math.inf
        caps = [self.batch_cap(tp, workload) for tp in tps]
        if self.longest_decodes == "alone":
            return max(map(self.instance_seconds, self._placed(tps, caps, workload)))
        share = max(1, math.ceil(self.in_flight(workload) / len(tps)))
        instances = self._placed(tps, [min(cap, share) for cap in caps], workload)
        batched = max(self._batched(instance)[0] for instance in instances if instance.count)
        waits = [max(1.0, share / cap) for cap in caps]
        return max(batched, self._spread_chain_seconds(instances, waits))

    def _placed(self, tps: Sequence[int], caps: Sequence[int], workload: Demand) -> list[_Instance]:
        instances = [_Instance(tp, cap) for tp, cap in zip(tps, caps, strict=True)]
        for request in sorted(self._requests(workload), key=_size, reverse=True):
            candidates = [instance.with_request(request) for instance in instances]
            finish = [self.instance_seconds(candidate) for candidate in candidates]
            best = finish.index(min(finish))
            instances[best] = candidates[best]
        return instances


def _size(request: Request) -> tuple[int, int]:
    return (request.output_tokens, request.prefill_tokens)


def _terms(
    cost: StepCost, prefill_tokens: float, steps: float, batch: float, context: float
) -> tuple[float, float, float]:
    decode_bytes = steps * (cost.step_base_s + cost.step_per_ctx_token_s * context)
    decode_compute = steps * cost.step_per_seq_s * batch
    return (cost.prefill_time(max(0.0, prefill_tokens)), decode_bytes, decode_compute)


# ----------------------------------------------------------------------------- training


class TrainSpec(Section):
    """What a training step costs, before any measurement."""

    mfu: float = Field(0.4, gt=0, le=1, description="fraction of peak FLOPs training reaches")
    link_bytes_per_s: PositiveFloat = Field(
        400e9, description="interconnect bytes/s per GPU for FSDP's collectives"
    )
    overhead_s: float = Field(2.0, ge=0, description="per step: optimizer, sync, launch")
    state_bytes_per_param: PositiveFloat = Field(
        16.0, description="bf16 weights and grads, fp32 master and two Adam moments"
    )
    activation_bytes_per_token: float = Field(
        4e5, ge=0, description="per token of a micro-batch, with activation checkpointing"
    )
    micro_batch_tokens: PositiveInt = 16384


@dataclass(slots=True)
class TrainCost:
    """Seconds a training step takes on ``workers`` GPUs under FSDP, and whether it fits.

    compute = tokens x 6 x params / (workers x peak x mfu); communication = an all-gather
    in forward and in backward plus a reduce-scatter of the gradients, each moving the
    bf16 weights' ``(workers - 1) / workers`` over the link; plus a per-step overhead.
    """

    gpu: Gpu
    parameters: float
    spec: TrainSpec = field(default_factory=TrainSpec)
    fit: Corrections = field(
        default_factory=lambda: Corrections(3, prior_weight=1e-4, shared_pull=True)
    )

    def terms(self, tokens: int, workers: int) -> tuple[float, float, float]:
        compute = (
            tokens * 6 * self.parameters / (workers * self.gpu.dense_bf16_flops * self.spec.mfu)
        )
        moved = 3 * 2 * self.parameters * (workers - 1) / workers
        return (compute, moved / self.spec.link_bytes_per_s, self.spec.overhead_s)

    def seconds(self, tokens: int, workers: int) -> float:
        return self.fit.apply(self.terms(tokens, workers))

    def observe(self, timing: StepTiming) -> None:
        if timing.train_workers > 0:
            terms = self.terms(timing.train_tokens, timing.train_workers)
            self.fit.add(terms, timing.train_s)

    def memory_per_worker(self, workers: int) -> float:
        states = self.parameters * self.spec.state_bytes_per_param / workers
        return states + self.spec.activation_bytes_per_token * self.spec.micro_batch_tokens

    def fits(self, workers: int) -> bool:
        usable = self.gpu.memory_bytes * self.gpu.gpu_memory_utilization
        return workers > 0 and self.memory_per_worker(workers) <= usable


def train_tokens(workload: Demand) -> int:
    """Tokens a step trains on: every trajectory's full context."""
    return sum(request.context_tokens for request in requests_of(workload))


def mean(values: Iterable[int]) -> float:
    items = list(values)
    return sum(items) / len(items) if items else 0.0
