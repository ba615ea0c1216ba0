"""The serving fleet, in the words every layer shares: endpoints, instances, buckets, cost.

A fleet is a set of OpenAI-compatible instances, each with its tensor-parallel degree,
batch and KV limits and a :class:`StepCost` (what a decode step and a prefill cost on
it). Buckets group instances under a token ceiling, shortest first: C-MLFQ's levels.
The engine talks to an :class:`Endpoint`; the scheduler routes over a :class:`FleetSpec`;
the emulator plays a :class:`StepCost` as its truth and the allocation planner prices
layouts with one. :class:`Gpu` and :class:`Model` give the datasheet roofline that
builds a :class:`StepCost` and a KV capacity for any TP degree.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy
from pydantic import Field, PositiveFloat, PositiveInt, model_validator

from libra.config import Section

Api = Literal["auto", "tokens", "chat"]


@dataclass(eq=False, slots=True)
class Endpoint:
    """One OpenAI-compatible server instance.

    ``api`` says how the engine talks to it: ``"tokens"`` sends the conversation as
    token ids to ``/v1/completions`` (exact tokens, needs ``/tokenize``); ``"chat"``
    sends messages to ``/v1/chat/completions`` (any OpenAI-compatible server);
    ``"auto"`` uses tokens where the server has ``/tokenize``.
    ``weight_version`` is bumped by whoever syncs weights into the server, on the object
    the router hands out (``Router.endpoints()``); a call records the version it was
    routed with.
    """

    url: str
    model: str = "default"
    api: Api = "auto"
    name: str = ""
    weight_version: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    #: What a generation call waits for its answer here before its per-token allowance;
    #: None: the engine's ``call_timeout_s``.
    call_timeout_s: float | None = None
    #: A header each generation call names its trajectory in (a ``libra serve``
    #: gateway's ``X-Libra-Session``: its scheduler then sees the trajectory's calls as
    #: one, turn after turn); None: none is sent.
    session_header: str | None = None

    def __post_init__(self) -> None:
        self.url = self.url.rstrip("/")
        if not self.name:
            self.name = self.url


class StepCost(Section):
    """Seconds a generation call costs on one instance.

    A decode step of ``B`` sequences holding ``C`` context tokens takes
    ``step_base_s + step_per_seq_s * B + step_per_ctx_token_s * C`` and gives each
    sequence one token; prefill takes ``prefill_s_per_token`` per uncached prompt token.
    """

    prefill_s_per_token: float = Field(ge=0, description="seconds per uncached prompt token")
    step_base_s: float = Field(ge=0, description="seconds of every decode step, whatever its batch")
    step_per_seq_s: float = Field(
        ge=0, description="seconds a decode step adds per sequence in its batch"
    )
    step_per_ctx_token_s: float = Field(
        ge=0, description="seconds a decode step adds per context token its sequences hold"
    )

    def step_time(self, batch_size: float, context_tokens: float) -> float:
        return (
            self.step_base_s
            + self.step_per_seq_s * batch_size
            + self.step_per_ctx_token_s * context_tokens
        )

    def prefill_time(self, tokens: float) -> float:
        return self.prefill_s_per_token * tokens

    @classmethod
    def for_tp(cls, tp: int) -> StepCost:
        """A generic model when none is given: a 14B-class model on A100-class GPUs
        (see ``libra/emulation/workloads/fleets/a100-qwen3-14b-2x4.toml`` for the
        derivation): weights and KV are read ``tp`` times faster, plus two all-reduces
        per layer."""
        allreduce_s = 2 * 40 * 5e-6 if tp > 1 else 0.0
        return cls(
            prefill_s_per_token=1.725e-4 / tp,
            step_base_s=0.001 + 0.0171 / tp + allreduce_s,
            step_per_seq_s=1.725e-4 / tp,
            step_per_ctx_token_s=9.45e-8 / tp,
        )


# ------------------------------------------------------------------ fitting a cost online


class Corrections:
    """Multiplicative corrections to the terms of a prior, fitted by ridge least squares.

    ``shared_pull``: every term is pulled to the prior as hard as the largest one, so a
    term worth a sliver of each measurement cannot soak up the residual with a large
    correction (the training fit: few steps, often at one worker count, where a constant
    term and the compute are not yet told apart)."""

    def __init__(
        self,
        terms: int,
        *,
        window: int = 64,
        prior_weight: float = 0.01,
        shared_pull: bool = False,
    ) -> None:
        self._rows: deque[tuple[tuple[float, ...], float]] = deque(maxlen=window)
        self._prior_weight = prior_weight
        self._shared_pull = shared_pull
        self._values: tuple[float, ...] | None = (1.0,) * terms

    def add(self, prior_terms: Sequence[float], measured_s: float) -> None:
        if measured_s <= 0 or not all(math.isfinite(term) for term in prior_terms):
            return
        self._rows.append((tuple(prior_terms), measured_s))
        self._values = None  # solved when next read: a step's calls come in thousands

    @property
    def values(self) -> tuple[float, ...]:
        if self._values is None:
            self._values = self._solve()
        return self._values

    @property
    def observations(self) -> int:
        return len(self._rows)

    def _solve(self) -> tuple[float, ...]:
        # Each row is the prior's terms over the measured seconds: a perfect fit makes
        # every row sum to 1 (relative error, so a long call weighs no more than a short one).
        terms = numpy.array([terms for terms, _ in self._rows])
        rows = terms / numpy.array([measured for _, measured in self._rows])[:, None]
        gram = rows.T @ rows
        # The pull to the prior is relative to what the data say of the term, so a term
        # worth 0.1% of every measurement is pulled as hard as one worth 90% (shared: as
        # hard as the largest term is, which keeps a small term's correction small).
        scale = numpy.diag(gram)
        pull = (
            self._prior_weight
            * (numpy.full_like(scale, scale.max()) if self._shared_pull else scale)
            + 1e-12
        )
        solution = numpy.linalg.solve(gram + numpy.diag(pull), rows.sum(axis=0) + pull)
        # A negative correction means a term is not separable yet: floor it, keep it positive.
        return tuple(max(float(value), 0.05) for value in solution)

    def apply(self, prior_terms: Sequence[float]) -> float:
        return sum(c * term for c, term in zip(self.values, prior_terms, strict=True))


# ---------------------------------------------------------------- the datasheet roofline


class Gpu(Section):
    """Datasheet figures of one accelerator, and how much of them is achieved."""

    name: str = ""
    memory_bytes: PositiveFloat
    hbm_bytes_per_s: PositiveFloat
    dense_bf16_flops: PositiveFloat
    bandwidth_utilization: float = Field(0.85, gt=0, le=1)
    prefill_mfu: float = Field(0.55, gt=0, le=1)
    decode_mfu: float = Field(0.55, gt=0, le=1)
    allreduce_s: float = Field(5e-6, ge=0)
    step_overhead_s: float = Field(1e-3, ge=0)
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    workspace_bytes: float = Field(1e9, ge=0)
    kv_fragmentation: float = Field(0.04, ge=0, lt=1)


class Model(Section):
    """The shape of a served model: what its weights and KV cache cost."""

    name: str = ""
    parameters: PositiveFloat
    layers: PositiveInt
    kv_heads: PositiveInt
    head_dim: PositiveInt
    dtype_bytes: PositiveInt = 2


@dataclass(frozen=True, slots=True)
class Roofline:
    """A model on a GPU: prefill by FLOPs, decode by the bytes read per step."""

    gpu: Gpu
    model: Model

    def kv_bytes_per_token_per_gpu(self, tp: int) -> float:
        """KV heads are split across the TP ranks (replicated when there are fewer)."""
        model = self.model
        heads = max(1, model.kv_heads // tp)
        return 2.0 * model.layers * heads * model.head_dim * model.dtype_bytes

    def kv_capacity_tokens(self, tp: int) -> int:
        gpu, model = self.gpu, self.model
        weights_per_gpu = model.parameters * model.dtype_bytes / tp
        free = gpu.memory_bytes * gpu.gpu_memory_utilization - weights_per_gpu
        free -= gpu.workspace_bytes
        return int(free / self.kv_bytes_per_token_per_gpu(tp) * (1 - gpu.kv_fragmentation))

    def step_cost(self, tp: int) -> StepCost:
        gpu, model = self.gpu, self.model
        bandwidth = gpu.hbm_bytes_per_s * gpu.bandwidth_utilization
        weights_per_gpu = model.parameters * model.dtype_bytes / tp
        flops_per_token = 2.0 * model.parameters
        allreduce = 2 * model.layers * gpu.allreduce_s if tp > 1 else 0.0
        return StepCost(
            prefill_s_per_token=flops_per_token / (tp * gpu.dense_bf16_flops * gpu.prefill_mfu),
            step_base_s=gpu.step_overhead_s + weights_per_gpu / bandwidth + allreduce,
            step_per_seq_s=flops_per_token / (tp * gpu.dense_bf16_flops * gpu.decode_mfu),
            step_per_ctx_token_s=self.kv_bytes_per_token_per_gpu(tp) / bandwidth,
        )


# ------------------------------------------------------------------ instances and buckets


class InstanceSpec(Section):
    """One serving instance (a vLLM server, or any OpenAI-compatible one)."""

    name: str = Field(min_length=1, description="its name, unique: buckets list it by this")
    url: str = Field(
        min_length=1, description="base URL of its OpenAI-compatible server (without /v1)"
    )
    model: str = Field(
        "default", description="model name to request; 'default': the first the server lists"
    )
    api: Api = Field(
        "auto",
        description="tokens: token ids to /v1/completions (needs /tokenize); chat: messages "
        "to /v1/chat/completions; auto: tokens where the server has /tokenize",
    )
    tp: PositiveInt = Field(1, description="tensor-parallel degree (GPUs of the instance)")
    max_num_seqs: PositiveInt = Field(256, description="vLLM's --max-num-seqs")
    kv_capacity_tokens: PositiveInt = Field(200_000, description="tokens its KV cache holds")
    cost: StepCost | None = Field(None, description="default: StepCost.for_tp(tp)")
    call_timeout_s: PositiveFloat | None = Field(
        None, description="a generation call's wait here (default: the engine's call_timeout_s)"
    )

    @property
    def step_cost(self) -> StepCost:
        return self.cost if self.cost is not None else StepCost.for_tp(self.tp)

    def endpoint(self) -> Endpoint:
        return Endpoint(
            self.url,
            model=self.model,
            api=self.api,
            name=self.name,
            call_timeout_s=self.call_timeout_s,
        )


class BucketSpec(Section):
    """A named group of instances for trajectories expected to need up to ``max_tokens``
    more output tokens (C-MLFQ's level)."""

    name: str = Field(min_length=1, description="its name, unique")
    max_tokens: PositiveInt = Field(
        description="its token ceiling: for trajectories expected to need up to this many "
        "more output tokens"
    )
    instances: list[str] = Field(
        min_length=1, description="the names of its instances (each in exactly one bucket)"
    )


class FleetSpec(Section):
    """Instances and buckets. Buckets are kept shortest first; every instance belongs to
    exactly one bucket (one bucket holding all of them when none are given)."""

    instances: list[InstanceSpec] = Field(min_length=1)
    buckets: list[BucketSpec] = Field(default_factory=list)
    max_queue_length: int = Field(
        3, ge=0, description="an instance with this many requests queued is full"
    )
    sticky_slack: float = Field(
        1.0,
        ge=0,
        description="keep a trajectory on its previous instance while that instance has "
        "at most this many more requests in flight (per unit of capacity) than the least "
        "loaded one: its prefix is cached there",
    )
    down_cooldown_s: float = Field(
        5.0, gt=0, description="an instance that failed a call is avoided this long (doubling)"
    )

    @model_validator(mode="after")
    def _check(self) -> FleetSpec:
        names = [instance.name for instance in self.instances]
        if len(set(names)) != len(names):
            raise ValueError("instance names must be unique")
        if not self.buckets:
            everything = BucketSpec(name="all", max_tokens=1 << 30, instances=names)
            object.__setattr__(self, "buckets", [everything])
        seen: list[str] = []
        for bucket in self.buckets:
            for name in bucket.instances:
                if name not in names:
                    raise ValueError(f"bucket {bucket.name!r} names unknown instance {name!r}")
                seen.append(name)
        if sorted(seen) != sorted(names):
            raise ValueError("every instance must belong to exactly one bucket")
        if len({bucket.name for bucket in self.buckets}) != len(self.buckets):
            raise ValueError("bucket names must be unique")
        ordered = sorted(self.buckets, key=lambda bucket: bucket.max_tokens)
        object.__setattr__(self, "buckets", ordered)
        return self
