"""The emulated GPU's cost figures: :class:`LatencyModel` (prefill seconds per prompt token,
decode step time as a function of batch size and context, batch and KV-cache limits), with
defaults derived from one H100's datasheet. ``_batching`` plays vLLM's scheduler with them."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from libra.fleet import StepCost

# Figures behind LatencyModel's defaults: one H100 SXM 80 GB serving a Qwen3-4B-sized model
# in bf16, derived from datasheet numbers, not measured. Illustrative until
# the scheduler work calibrates them.
_HBM_BYTES_PER_S = 3.35e12 * 0.85  # 3.35 TB/s at ~85% achieved bandwidth
_DENSE_FLOPS = 990e12 * 0.55  # 990 TFLOP/s dense bf16 at ~55% utilisation in prefill
_PARAMETERS = 4.0e9
_KV_BYTES_PER_TOKEN = 2 * 36 * 8 * 128 * 2  # K and V x layers x KV heads x head dim x bf16
_KV_BUDGET_BYTES = 80e9 * 0.9 - 2 * _PARAMETERS - 4e9  # gpu_memory_utilization 0.9 - weights
#                                                       - ~4 GB activations and graphs


KVAllocation = Literal["reserve", "on_demand"]


class LatencyModel(StepCost):
    """Cost model of one emulated inference server (times in seconds, sizes in tokens):
    a :class:`~libra.fleet.StepCost` with defaults, plus the batch and KV-cache limits.

    A request spends ``prefill_s_per_token * prompt_tokens`` in prefill, then joins the
    running batch; each decode step of a batch of ``B`` sequences holding ``C`` context
    tokens in total takes ``step_base_s + step_per_seq_s * B + step_per_ctx_token_s * C``
    and gives every sequence in the batch one token.

    The defaults resemble a 4B-parameter model in bf16 on one H100 (weights read once per
    step, KV cache read per context token, prefill compute-bound); they are derived from
    datasheet figures and are illustrative, not measured.
    """

    prefill_s_per_token: float = Field(
        default=round(2 * _PARAMETERS / _DENSE_FLOPS, 7),
        ge=0,
        description="Seconds of prefill per prompt token (2 FLOPs per parameter per token).",
    )
    step_base_s: float = Field(
        default=0.005,
        ge=0,
        description="Fixed seconds per decode step: reading the weights once (~2.8 ms) "
        "plus scheduling, sampling and launch overheads.",
    )
    step_per_seq_s: float = Field(
        default=3e-5,
        ge=0,
        description="Extra seconds per decode step for each sequence in the batch.",
    )
    step_per_ctx_token_s: float = Field(
        default=round(_KV_BYTES_PER_TOKEN / _HBM_BYTES_PER_S, 10),
        ge=0,
        description="Extra seconds per decode step for each context token in the batch "
        "(reading its KV cache: 144 KiB per token).",
    )
    max_num_seqs: int = Field(
        default=256, ge=1, description="Most sequences in the running batch (vLLM's max_num_seqs)."
    )
    kv_capacity_tokens: int = Field(
        default=int(_KV_BUDGET_BYTES // _KV_BYTES_PER_TOKEN),
        ge=1,
        description="Tokens the KV cache holds.",
    )
    kv_allocation: KVAllocation = Field(
        default="reserve",
        description="'reserve': a request is admitted once the cache holds its prompt plus "
        "every token it will generate, and is never preempted (the emulator knows each "
        "reply's length); 'on_demand': vLLM's allocation, where a request is admitted "
        "when its context fits, takes a token's room per step, and the lowest-priority "
        "running request (highest priority value, then latest arrival) is preempted and "
        "later recomputed when the batch outgrows the cache.",
    )
    prefill_interference: float = Field(
        default=0.0,
        ge=0,
        description="Relative slowdown of the decode steps that run while a request of the "
        "batch prefills (chunked prefill shares the step with decode); 0: none.",
    )
    jitter: float = Field(
        default=0.0,
        ge=0,
        description="Lognormal sigma of each run of decode steps' duration (seeded); 0: none.",
    )

    @classmethod
    def zero(cls) -> LatencyModel:
        """No waiting at all: the server answers at once, without a batching loop."""
        return cls(
            prefill_s_per_token=0.0,
            step_base_s=0.0,
            step_per_seq_s=0.0,
            step_per_ctx_token_s=0.0,
            max_num_seqs=1 << 30,
            kv_capacity_tokens=1 << 62,
        )

    @property
    def is_zero(self) -> bool:
        """True when no request ever waits (no time costs, no limit a server could hit)."""
        return self == LatencyModel.zero()
