"""The fleet's vocabulary: endpoints, a consistent fleet spec, and the step cost of an
instance, generic or from the datasheet roofline."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from libra.emulation.workloads import package_file, read_toml
from libra.fleet import (
    BucketSpec,
    Endpoint,
    FleetSpec,
    Gpu,
    InstanceSpec,
    Model,
    Roofline,
    StepCost,
)


def test_a_fleet_must_be_consistent() -> None:
    one = [InstanceSpec(name="x", url="http://x")]
    with pytest.raises(ValidationError, match="unknown instance"):
        FleetSpec(instances=one, buckets=[BucketSpec(name="b", max_tokens=1, instances=["y"])])
    with pytest.raises(ValidationError, match="exactly one bucket"):
        FleetSpec(instances=[*one, InstanceSpec(name="z", url="http://z")],
                  buckets=[BucketSpec(name="b", max_tokens=1, instances=["x"])])  # fmt: skip
    assert [b.name for b in FleetSpec(instances=one).buckets] == ["all"]


def test_step_cost_defaults_scale_with_tensor_parallelism() -> None:
    one, four = StepCost.for_tp(1), StepCost.for_tp(4)
    assert four.step_time(1, 8000) < one.step_time(1, 8000) / 2  # faster per token
    assert four.step_time(1, 8000) * 4 > one.step_time(1, 8000)  # but not per GPU
    assert InstanceSpec(name="x", url="http://x", tp=2).step_cost == StepCost.for_tp(2)


def test_an_endpoint_is_named_by_its_url_unless_named() -> None:
    assert Endpoint("http://a:8000/").url == "http://a:8000"
    assert Endpoint("http://a:8000/").name == "http://a:8000"
    spec = InstanceSpec(name="small", url="http://a/", model="m", api="chat")
    endpoint = spec.endpoint()
    assert (endpoint.url, endpoint.name, endpoint.model, endpoint.api) == (
        "http://a",
        "small",
        "m",
        "chat",
    )
    assert endpoint.call_timeout_s is None  # the engine's call_timeout_s applies
    assert InstanceSpec(name="s", url="http://s", call_timeout_s=5).endpoint().call_timeout_s == 5


def shipped_roofline() -> Roofline:
    """Qwen3-14B on A100-80GB, as the shipped fleet file sources it."""
    data = read_toml(package_file("a100-qwen3-14b-2x4", folder="fleets"))
    return Roofline(Gpu.model_validate(data["gpu"]), Model.model_validate(data["model"]))


def test_the_roofline_of_the_shipped_fleet_gives_its_documented_figures() -> None:
    roofline = shipped_roofline()
    # 40 layers x 8 KV heads x 128 dims x 2 (K and V) x 2 bytes: 160 KiB per token.
    assert roofline.kv_bytes_per_token_per_gpu(1) == 160 * 1024
    assert roofline.kv_bytes_per_token_per_gpu(2) == 80 * 1024
    assert roofline.kv_bytes_per_token_per_gpu(16) == 20 * 1024  # 1 head each: replicated
    # (80 GB x 0.88 - 29.6 GB of weights - 1 GB of workspace) / 160 KiB x 0.96
    assert roofline.kv_capacity_tokens(1) == int(39.8e9 / (160 * 1024) * 0.96)
    tp1 = roofline.step_cost(1)
    # Decode reads the weights once per step: 29.6 GB at 85% of 2,039 GB/s, plus 1 ms.
    assert tp1.step_base_s == pytest.approx(1e-3 + 29.6e9 / (0.85 * 2.039e12))
    # Prefill: 2 x 14.8 GFLOP per token at 55% of 312 TFLOP/s.
    assert tp1.prefill_s_per_token == pytest.approx(29.6e9 / (0.55 * 312e12))
    tp4 = roofline.step_cost(4)
    allreduces = 2 * 40 * 5e-6
    assert tp4.step_base_s == pytest.approx(1e-3 + 29.6e9 / 4 / (0.85 * 2.039e12) + allreduces)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_the_generic_step_cost_is_the_shipped_fleets_roofline(tp: int) -> None:
    exact, generic = shipped_roofline().step_cost(tp), StepCost.for_tp(tp)
    for field in StepCost.model_fields:
        assert getattr(generic, field) == pytest.approx(getattr(exact, field), rel=0.005)
