"""What an emulated serving instance really costs: the truth the benchmarks play.

The planner prices layouts with the datasheet roofline (:class:`~libra.fleet.Roofline`)
and fits corrections from what the run measures. If the emulator played that same
roofline, the benchmark would grade a perfectly calibrated planner, which no deployment
has. :class:`ServingTruth` builds the :class:`LatencyModel` an instance really plays from
the same GPU and model, off the datasheet through knobs the planner cannot read: achieved
bandwidth and MFU below the prior's, tensor parallelism that speeds a step up by less
than its degree, an all-reduce whose cost grows with the batch, prefill slowing the decode
steps it shares, seeded jitter, less KV room; and what starting a server and reloading
its weights take. The scheduling benchmark plays one under ``--mismatch`` while C-MLFQ
decides with the prior.
"""

from __future__ import annotations

import math

from pydantic import Field, NonNegativeFloat, PositiveFloat

from libra.config import Section
from libra.emulation._latency import LatencyModel
from libra.fleet import Gpu, Model, Roofline


class ServingTruth(Section):
    """How the emulated servers really perform (defaults: off from an A100 datasheet prior
    by tens of percent, in different directions per term on purpose)."""

    bandwidth: float = Field(
        0.82, gt=0, le=2, description="achieved HBM bandwidth relative to the prior's"
    )
    mfu: float = Field(0.7, gt=0, le=2, description="achieved prefill/decode MFU over the prior's")
    tp_efficiency: float = Field(
        0.88, gt=0, le=1, description="speed-up each doubling of TP keeps (1: linear)"
    )
    allreduce_s: NonNegativeFloat = Field(
        2e-5, description="seconds of each TP all-reduce (two per layer), whatever the batch"
    )
    allreduce_per_seq_s: NonNegativeFloat = Field(
        1.5e-7, description="seconds each sequence of the batch adds to one all-reduce"
    )
    prefill_interference: NonNegativeFloat = Field(
        0.3, description="relative slowdown of decode steps shared with a prefill"
    )
    jitter: NonNegativeFloat = Field(0.05, description="lognormal sigma of a run of steps")
    kv_capacity: float = Field(
        1.0, gt=0, le=1, description="share of the prior's KV capacity really available"
    )
    start_s: NonNegativeFloat = Field(90.0, description="starting a server: load, compile, warm")
    reload_s: NonNegativeFloat = Field(15.0, description="reloading weights into a live server")
    sync_bytes_per_s: PositiveFloat = Field(
        20e9, description="bytes per second of the trainer-to-servers weight broadcast"
    )

    def latency(self, gpu: Gpu, model: Model, tp: int, max_num_seqs: int = 256) -> LatencyModel:
        """The latency model a TP``tp`` instance of ``model`` on ``gpu`` really plays."""
        roofline = Roofline(gpu, model)
        prior = roofline.step_cost(tp)
        bytes_speed = self.bandwidth * self.tp_speedup(tp) / tp
        compute_speed = self.mfu * self.tp_speedup(tp) / tp
        reduces = 2 * model.layers if tp > 1 else 0
        base = (prior.step_base_s - gpu.step_overhead_s - _prior_allreduce(gpu, model, tp)) / (
            bytes_speed
        )
        return LatencyModel(
            prefill_s_per_token=prior.prefill_s_per_token / compute_speed,
            step_base_s=gpu.step_overhead_s + base + reduces * self.allreduce_s,
            step_per_seq_s=prior.step_per_seq_s / compute_speed
            + reduces * self.allreduce_per_seq_s,
            step_per_ctx_token_s=prior.step_per_ctx_token_s / bytes_speed,
            max_num_seqs=max_num_seqs,
            kv_capacity_tokens=max(1, int(roofline.kv_capacity_tokens(tp) * self.kv_capacity)),
            prefill_interference=self.prefill_interference,
            jitter=self.jitter,
        )

    @classmethod
    def calibrated(cls, gpu: Gpu) -> ServingTruth:
        """The prior itself: every knob where the datasheet roofline puts it."""
        return cls(
            bandwidth=1.0,
            mfu=1.0,
            tp_efficiency=1.0,
            allreduce_s=gpu.allreduce_s,
            allreduce_per_seq_s=0.0,
            prefill_interference=0.0,
            jitter=0.0,
        )

    def tp_speedup(self, tp: int) -> float:
        """How many times faster than TP1 a TP``tp`` instance's step runs (below ``tp``)."""
        return float(tp * self.tp_efficiency ** math.log2(tp))

    def sync_s(self, model: Model) -> float:
        """Broadcasting new weights from the trainer to the servers."""
        return model.parameters * model.dtype_bytes / self.sync_bytes_per_s


def _prior_allreduce(gpu: Gpu, model: Model, tp: int) -> float:
    return 2 * model.layers * gpu.allreduce_s if tp > 1 else 0.0
