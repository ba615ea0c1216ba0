"""Fleet files for the scheduling benchmark: GPUs, model, instances, buckets.

A fleet file (TOML; shipped ones live in ``libra/emulation/workloads/fleets/``) gives the GPU and
model constants, the instances on each node by TP degree, and the buckets. From them
:class:`FleetFile` derives both halves of the benchmark: each emulated server's
:class:`~libra.emulation.LatencyModel` (the "truth" the emulator plays) and the
scheduler's :class:`~libra.sched.FleetSpec`, whose per-instance cost is always the
datasheet roofline (the scheduler's prior). Without a ``truth`` the emulator plays that
same roofline (a perfectly calibrated scheduler); a :class:`~libra.emulation.ServingTruth`
(a mismatch preset, :func:`with_mismatch`) makes the servers play something else, through
knobs the scheduler never sees.
"""

from __future__ import annotations

from typing import Literal

import pydantic
from pydantic import Field, PositiveInt, model_validator

from libra.config import Section
from libra.emulation import KVAllocation, LatencyModel, ServingTruth
from libra.emulation.workloads import WorkloadError, package_file, read_toml
from libra.fleet import BucketSpec, FleetSpec, Gpu, InstanceSpec, Model, Roofline, StepCost


class Serving(Section):
    max_num_seqs: PositiveInt = 256
    max_queue_length: int = Field(3, ge=0)
    prefix_caching: bool = True
    kv_allocation: KVAllocation = Field(
        "on_demand",
        description="how the emulated servers take KV room: 'on_demand' as vLLM does (a "
        "token's room per step, the lowest-priority request preempted when the cache "
        "runs short); 'reserve' a request's whole reply up front, never preempting",
    )


class Node(Section):
    instances: list[PositiveInt] = Field(min_length=1, description="TP degree of each")


class BucketFile(Section):
    name: str
    tp: list[PositiveInt] = Field(min_length=1, description="TP degrees of its instances")
    max_tokens: PositiveInt


class InstancePlan(Section):
    """One instance of the fleet: where it runs, its TP and its bucket."""

    name: str
    node: int
    tp: int
    bucket: str


class FleetFile(Section):
    name: str
    description: str = ""
    gpu: Gpu
    model: Model
    serving: Serving = Serving()
    node: list[Node] = Field(min_length=1)
    bucket: list[BucketFile] = Field(min_length=1)
    truth: ServingTruth | None = Field(
        None, description="how the emulated servers really perform; none: the prior itself"
    )

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

    @property
    def roofline(self) -> Roofline:
        return Roofline(self.gpu, self.model)

    def kv_capacity_tokens(self, tp: int) -> int:
        return self.roofline.kv_capacity_tokens(tp)

    def step_cost(self, tp: int) -> StepCost:
        return self.roofline.step_cost(tp)

    def latency(self, tp: int) -> LatencyModel:
        """The emulated server of a TP``tp`` instance: what it really plays."""
        allocation = self.serving.kv_allocation
        if self.truth is not None:
            truth = self.truth.latency(self.gpu, self.model, tp, self.serving.max_num_seqs)
            return truth.model_copy(update={"kv_allocation": allocation})
        return LatencyModel(
            **self.step_cost(tp).model_dump(),
            max_num_seqs=self.serving.max_num_seqs,
            kv_capacity_tokens=self.kv_capacity_tokens(tp),
            kv_allocation=allocation,
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

# ------------------------------------------------------------------ mismatch presets

MISMATCH_PRESETS: dict[str, str] = {
    "none": "the servers play the scheduler's own roofline (a perfectly calibrated run)",
    "datasheet": "bandwidth 0.82x, MFU 0.7x, TP efficiency 0.88 per doubling, all-reduce "
    "20 us + 0.15 us per sequence, prefill slows shared decode steps 30%, jitter 5%",
    "slow-tp": "all-reduce 40 us instead of 5 us, TP efficiency 0.8 per doubling",
    "low-bandwidth": "bandwidth and MFU 30% below the datasheet",
    "small-kv": "half the KV capacity the roofline gives",
}
#: The servers are never what the datasheet says: the benchmark grades a scheduler that
#: has to live with that unless asked for the calibrated run.
DEFAULT_MISMATCH = "datasheet"


def mismatch_truth(preset: str, gpu: Gpu) -> ServingTruth | None:
    """What the servers really play under ``preset`` (None: the prior itself)."""
    if preset not in MISMATCH_PRESETS:
        choices = ", ".join(MISMATCH_PRESETS)
        raise ValueError(f"unknown mismatch preset {preset!r}; choose from {choices}")
    calibrated = ServingTruth.calibrated(gpu)
    knobs: dict[str, dict[str, float]] = {
        "slow-tp": {"allreduce_s": 40e-6, "tp_efficiency": 0.8},
        "low-bandwidth": {"bandwidth": 0.7, "mfu": 0.7},
        "small-kv": {"kv_capacity": 0.5},
    }
    if preset == "none":
        return None
    if preset == "datasheet":
        return ServingTruth()
    return calibrated.model_copy(update=knobs[preset])


def with_mismatch(fleet: FleetFile, preset: str) -> FleetFile:
    """``fleet`` whose servers play ``preset``'s truth; the scheduler's inputs unchanged."""
    return fleet.model_copy(update={"truth": mismatch_truth(preset, fleet.gpu)})


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
