"""The allocation's planner for a run: the roofline of the run's model on its GPU preset,
pricing the longest trajectory as the run's scheduler routes it."""

from __future__ import annotations

import json
import math
from pathlib import Path

from libra.alloc import PRESETS, LongestDecodes, PlannerConfig, RooflinePlanner
from libra.fleet import Model, Roofline
from libra.sched.policies import REGISTRY


def rule_planner(model_dir: Path, gpu: str, scheduler: str) -> RooflinePlanner:
    """A roofline planner for the model in ``model_dir`` on ``gpu`` (a preset's name):
    what the loop re-plans with when its trigger fires. It prices the longest trajectory
    as the run's ``scheduler`` (a policy's name) routes it: C-MLFQ demotes the long ones
    to instances of their own, the baselines spread their turns through full batches."""
    alone = REGISTRY[scheduler].isolates_long_decodes
    routing: LongestDecodes = "alone" if alone else "in_batch"
    config = PlannerConfig(longest_decodes=routing)
    return RooflinePlanner(Roofline(PRESETS[gpu], model_shape(model_dir)), config)


def model_shape(model_dir: Path) -> Model:
    """The served model's shape, from its Hugging Face config and weight headers."""
    from safetensors import safe_open

    hf = json.loads((model_dir / "config.json").read_text())
    parameters = 0
    for shard in sorted(model_dir.glob("*.safetensors")):
        with safe_open(shard, "pt") as tensors:
            for name in tensors.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                parameters += math.prod(tensors.get_slice(name).get_shape())
    heads = int(hf["num_attention_heads"])
    return Model(
        name=model_dir.name,
        parameters=float(max(parameters, 1)),
        layers=int(hf["num_hidden_layers"]),
        kv_heads=int(hf.get("num_key_value_heads", heads)),
        head_dim=int(hf.get("head_dim") or hf["hidden_size"] // heads),
    )
