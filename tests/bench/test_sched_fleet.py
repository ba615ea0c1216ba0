"""The bench's fleet file: instances derived from the cost model, validation, and the
mismatch presets."""

from __future__ import annotations

from pathlib import Path

import pytest

from libra.bench._sched_fleet import MISMATCH_PRESETS, load_fleet, mismatch_truth, with_mismatch
from libra.emulation.workloads import WorkloadError
from tests._helpers import write


def test_the_reference_fleet_derives_each_instance_from_the_cost_model() -> None:
    fleet = load_fleet()
    assert [plan.tp for plan in fleet.instances] == [1, 1, 2, 4, 1, 1, 2, 4]
    assert fleet.gpus == 16
    kv = [fleet.kv_capacity_tokens(tp) for tp in (1, 2, 4)]
    assert 200_000 < kv[0] < kv[1] < kv[2]  # ~39 GB free on one A100 / 160 KiB per token
    tp1, tp4 = fleet.latency(1), fleet.latency(4)
    alone_tp1, alone_tp4 = tp1.step_time(1, 8000), tp4.step_time(1, 8000)
    assert 0.015 < alone_tp1 < 0.025 and 2.5 < alone_tp1 / alone_tp4 < 4
    spec = fleet.spec("m")
    assert [b.name for b in spec.buckets] == ["short", "medium", "long"]
    assert spec.instances[3].cost == fleet.step_cost(4) and spec.max_queue_length == 3


def test_the_servers_take_kv_room_as_vllm_does_unless_told_to_reserve() -> None:
    fleet = load_fleet()
    for preset in MISMATCH_PRESETS:
        assert with_mismatch(fleet, preset).latency(2).kv_allocation == "on_demand", preset
    serving = fleet.serving.model_copy(update={"kv_allocation": "reserve"})
    reserving = with_mismatch(fleet.model_copy(update={"serving": serving}), "datasheet")
    assert reserving.latency(2).kv_allocation == "reserve"


def test_an_invalid_fleet_is_refused(tmp_path: Path) -> None:
    text = (Path(str(_shipped_fleet())).read_text()).replace("tp = [4]", "tp = [8]")
    with pytest.raises(WorkloadError, match=r"no bucket takes instances of TP \[4\]"):
        load_fleet(str(write(tmp_path, text, "fleet.toml")))


def _shipped_fleet() -> Path:
    from libra.emulation.workloads import package_file

    return package_file("a100-qwen3-14b-2x4", folder="fleets")


def test_a_mismatch_preset_changes_the_servers_never_the_scheduler() -> None:
    fleet = load_fleet()
    tps = sorted({plan.tp for plan in fleet.instances})
    for preset in MISMATCH_PRESETS:
        played = with_mismatch(fleet, preset)
        assert played.spec("m") == fleet.spec("m")  # the scheduler's inputs: the prior
        assert played.instances == fleet.instances
        if preset == "none":
            assert all(played.latency(tp) == fleet.latency(tp) for tp in tps)
        else:
            assert any(played.latency(tp) != fleet.latency(tp) for tp in tps), preset
    slow = with_mismatch(fleet, "slow-tp")
    assert slow.latency(1) == fleet.latency(1)  # no all-reduce on one GPU
    assert slow.latency(4).step_base_s > fleet.step_cost(4).step_base_s
    small = with_mismatch(fleet, "small-kv").latency(2).kv_capacity_tokens
    assert small < fleet.kv_capacity_tokens(2)
    with pytest.raises(ValueError, match="unknown mismatch preset"):
        mismatch_truth("fast", fleet.gpu)
