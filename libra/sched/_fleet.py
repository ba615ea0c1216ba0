"""The scheduler's view of a serving fleet: instances, their cost, and the buckets.

A fleet is a set of OpenAI-compatible instances, each with its tensor-parallel degree,
batch and KV limits and a :class:`StepCost` (what a decode step and a prefill cost on
it: the scheduler's model, which a deployment calibrates from measurements). Buckets
group instances under a token ceiling, shortest first: C-MLFQ's levels.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, model_validator

from libra.sched._protocol import Endpoint


class _Config(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class StepCost(_Config):
    """Seconds a generation call costs on one instance.

    A decode step of ``B`` sequences holding ``C`` context tokens takes
    ``step_base_s + step_per_seq_s * B + step_per_ctx_token_s * C`` and gives each
    sequence one token; prefill takes ``prefill_s_per_token`` per uncached prompt token.
    """

    prefill_s_per_token: float = Field(ge=0)
    step_base_s: float = Field(ge=0)
    step_per_seq_s: float = Field(ge=0)
    step_per_ctx_token_s: float = Field(ge=0)

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
        (see ``libra/workloads/fleets/a100-qwen3-14b-2x4.toml`` for the derivation):
        weights and KV are read ``tp`` times faster, plus two all-reduces per layer."""
        allreduce_s = 2 * 40 * 5e-6 if tp > 1 else 0.0
        return cls(
            prefill_s_per_token=1.725e-4 / tp,
            step_base_s=0.001 + 0.0171 / tp + allreduce_s,
            step_per_seq_s=1.725e-4 / tp,
            step_per_ctx_token_s=9.45e-8 / tp,
        )


class InstanceSpec(_Config):
    """One serving instance (a vLLM server, or any OpenAI-compatible one)."""

    name: str = Field(min_length=1)
    url: str = Field(min_length=1)
    model: str = "default"
    api: Literal["auto", "tokens", "chat"] = "auto"
    tp: PositiveInt = Field(1, description="tensor-parallel degree (GPUs of the instance)")
    max_num_seqs: PositiveInt = Field(256, description="vLLM's --max-num-seqs")
    kv_capacity_tokens: PositiveInt = Field(200_000, description="tokens its KV cache holds")
    cost: StepCost | None = Field(None, description="default: StepCost.for_tp(tp)")

    @property
    def step_cost(self) -> StepCost:
        return self.cost if self.cost is not None else StepCost.for_tp(self.tp)

    def endpoint(self) -> Endpoint:
        return Endpoint(self.url, model=self.model, api=self.api, name=self.name)


class BucketSpec(_Config):
    """A named group of instances for trajectories expected to need up to ``max_tokens``
    more output tokens (C-MLFQ's level)."""

    name: str = Field(min_length=1)
    max_tokens: PositiveInt
    instances: list[str] = Field(min_length=1)


class FleetSpec(_Config):
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
