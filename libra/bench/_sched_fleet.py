"""Fleet files for the scheduling benchmark: GPUs, model, instances, buckets.

A fleet file (TOML; shipped ones live in ``libra/workloads/fleets/``) gives the GPU and
model constants, the instances on each node by TP degree, and the buckets. From them
:class:`FleetFile` derives both halves of the benchmark: each emulated server's
:class:`~libra.emulation.LatencyModel` (the "truth" the emulator plays) and the
scheduler's :class:`~libra.sched.FleetSpec` with the same per-instance cost (a
perfectly calibrated scheduler; a real deployment fits it to measurements).
"""

from __future__ import annotations

from typing import Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt, model_validator

from libra.emulation import LatencyModel
from libra.sched import BucketSpec, FleetSpec, InstanceSpec, StepCost
from libra.workloads import WorkloadError, package_file, read_toml


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Gpu(_Section):
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


class Model(_Section):
    name: str = ""
    parameters: PositiveFloat
    layers: PositiveInt
    kv_heads: PositiveInt
    head_dim: PositiveInt
    dtype_bytes: PositiveInt = 2


class Serving(_Section):
    max_num_seqs: PositiveInt = 256
    max_queue_length: int = Field(3, ge=0)
    prefix_caching: bool = True


class Node(_Section):
    instances: list[PositiveInt] = Field(min_length=1, description="TP degree of each")


class BucketFile(_Section):
    name: str
    tp: list[PositiveInt] = Field(min_length=1, description="TP degrees of its instances")
    max_tokens: PositiveInt


class InstancePlan(_Section):
    """One instance of the fleet: where it runs, its TP and its bucket."""

    name: str
    node: int
    tp: int
    bucket: str


class FleetFile(_Section):
    name: str
    description: str = ""
    gpu: Gpu
    model: Model
    serving: Serving = Serving()
    node: list[Node] = Field(min_length=1)
    bucket: list[BucketFile] = Field(min_length=1)

    @model_validator(mode="after")
    def _check(self) -> FleetFile:
        tps = {tp for node in self.node for tp in node.instances}
        claimed = [tp for bucket in self.bucket for tp in bucket.tp]
        if len(set(claimed)) != len(claimed):
            raise ValueError("a TP degree may belong to one bucket only")
        if missing := tps - set(claimed):
            raise ValueError(f"no bucket takes instances of TP {sorted(missing)}")
        for tp in tps:
            if self.kv_capacity_tokens(tp) < 1:
                raise ValueError(f"the model's weights do not fit a TP{tp} instance")
        return self

    # ----------------------------------------------------------------- the layout

    @property
    def instances(self) -> list[InstancePlan]:
        bucket_of_tp = {tp: bucket.name for bucket in self.bucket for tp in bucket.tp}
        plans = []
        for index, node in enumerate(self.node):
            for position, tp in enumerate(node.instances):
                name = f"n{index}-{position}-tp{tp}"
                plans.append(InstancePlan(name=name, node=index, tp=tp, bucket=bucket_of_tp[tp]))
        return plans

    @property
    def gpus(self) -> int:
        return sum(sum(node.instances) for node in self.node)

    # --------------------------------------------------------------- the cost model

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

    def latency(self, tp: int) -> LatencyModel:
        """The emulated server of a TP``tp`` instance."""
        cost = self.step_cost(tp)
        return LatencyModel(
            prefill_s_per_token=cost.prefill_s_per_token,
            step_base_s=cost.step_base_s,
            step_per_seq_s=cost.step_per_seq_s,
            step_per_ctx_token_s=cost.step_per_ctx_token_s,
            max_num_seqs=self.serving.max_num_seqs,
            kv_capacity_tokens=self.kv_capacity_tokens(tp),
        )

    # ------------------------------------------------------------ for the scheduler

    def spec(self, model_name: str, api: Literal["auto", "tokens", "chat"] = "tokens") -> FleetSpec:
        """The scheduler's fleet: instance ``name`` is served at ``http://name``."""
        plans = self.instances
        instances = [
            InstanceSpec(
                name=plan.name,
                url=f"http://{plan.name}",
                model=model_name,
                api=api,
                tp=plan.tp,
                max_num_seqs=self.serving.max_num_seqs,
                kv_capacity_tokens=self.kv_capacity_tokens(plan.tp),
                cost=self.step_cost(plan.tp),
            )
            for plan in plans
        ]
        buckets = [
            BucketSpec(
                name=bucket.name,
                max_tokens=bucket.max_tokens,
                instances=[plan.name for plan in plans if plan.bucket == bucket.name],
            )
            for bucket in self.bucket
            if any(plan.bucket == bucket.name for plan in plans)
        ]
        return FleetSpec(
            instances=instances,
            buckets=buckets,
            max_queue_length=self.serving.max_queue_length,
        )


DEFAULT_FLEET = "a100-qwen3-14b-2x4"


def load_fleet(name_or_path: str = DEFAULT_FLEET) -> FleetFile:
    """A shipped fleet by name, or a fleet file by path; validated."""
    path = package_file(name_or_path, folder="fleets")
    try:
        return FleetFile.model_validate(read_toml(path))
    except pydantic.ValidationError as exc:
        errors = "\n".join(
            f"  {'.'.join(map(str, e['loc'])) or '(top level)'}: {e['msg']}" for e in exc.errors()
        )
        raise WorkloadError(f"{path}: invalid fleet:\n{errors}") from exc
