"""``TrainRunConfig``: everything ``libra train`` reads, and the run folder it writes.

A run folder holds::

    config.toml            the resolved config (loads back with ``libra train --config``)
    metrics.jsonl          one JSON object a step (see ``libra.train.StepRecord``)
    rollouts/step-K.jsonl  the records of step K, each appended as it finishes
    weights/vK/            the weights after K optimizer steps (v0: the served start)
    checkpoints/step-K/    what ``libra train --resume`` starts step K from
    events.jsonl           the run's event stream (``libra view RUN_DIR``)
    tracking/              with ``[tracking]``: TensorBoard's, W&B's and MLflow's files
    plot.png               ``libra plot RUN_DIR``
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, PositiveInt, model_validator

from libra.launch._rollout import RolloutConfig
from libra.serving import VLLMServerConfig, WeightSyncConfig
from libra.tracking import TrackingConfig
from libra.train import EvalConfig, Mode, OnlineConfig
from libra.trainer import GRPOConfig, LogprobsMode, TrainConfig, TrainerConfig
from libra.workers import AllocConfig

# What the loop itself sets in each step's rollout: naming them in [rollout] is an error.
_LOOP_OWNED = ("n", "out", "plot", "samples_per_prompt")


class TrainRunConfig(BaseModel):
    """``libra train``'s config: the rollout, the trainer, and how the loop joins them."""

    model_config = ConfigDict(extra="forbid")

    rollout: RolloutConfig
    steps: PositiveInt = Field(
        2, description="RL steps to run: each a rollout of its groups, then one optimizer step"
    )
    prompts_per_step: PositiveInt = Field(
        4, description="tasks per step (its GRPO groups), each sampled samples_per_prompt times"
    )
    samples_per_prompt: PositiveInt = Field(4, description="a GRPO group's size")
    mode: Mode = Field(
        "sync",
        description="sync: step k's rollouts, then its training; one-step-off: step k+1's "
        "rollouts run on the old weights while step k trains (bound: grpo.max_staleness); "
        "async: steps k+1 to k+max_ahead's do",
    )
    max_ahead: PositiveInt = Field(
        2, description="async: how many steps' rollouts run ahead of the step that trains"
    )
    model: str = Field(
        "embedded",
        description="the model trained and served: embedded (SmolLM2-135M-Instruct, "
        "shipped), a local Hugging Face folder, or a hub name (Qwen/Qwen2.5-0.5B-Instruct, "
        "downloaded where the machine reaches the hub)",
    )
    serve: str | None = Field(
        None,
        description="attach to running server URL(s) (dev mode, started from an untied "
        "folder), or to one libra serve gateway (admin key: $LIBRA_ADMIN_KEY), instead of "
        "rollout.server",
    )
    reload_weights: bool | None = Field(
        None,
        description="load each new version into the servers; False: bump the endpoints' "
        "versions only (an emulated server holds no weights); None: False when emulated",
    )
    logprobs_mode: LogprobsMode = Field(
        "processed_logprobs",
        description="the servers' --logprobs-mode: the loop's own server is started so; "
        "processed: the records' logprobs are at the sampling temperature, as the ratio needs",
    )
    export_dtype: str | None = Field(
        "float32",
        description="dtype of exported weights (and of the loop's own server): fp32 keeps "
        "small updates that bf16 rounds away; None: the model folder's",
    )
    run_dir: Path = Field(
        Path("runs/train"),
        description="the run folder: config.toml, metrics.jsonl, rollouts/, weights/ and "
        "checkpoints/",
    )
    seed: int = Field(0, description="seeds each step's tasks (step k draws with seed + k)")
    checkpoint_every: NonNegativeInt = Field(
        1,
        description="write a checkpoint (``--resume`` goes on from it) every this many steps "
        "and after the last; 0: never",
    )
    keep_last: PositiveInt = Field(3, description="the newest checkpoints kept")
    keep_best: str | None = Field(
        None,
        pattern=r"^eval/[^/]+/[^/]+$",
        description="eval/<env>/<figure> (pass@1, pass@k, reward_mean): also keep the "
        "checkpoint whose evaluation scored highest on it (checkpoints/best.json)",
    )
    trainer: TrainerConfig = TrainerConfig()
    grpo: GRPOConfig = GRPOConfig()
    train: TrainConfig = TrainConfig()
    sync: WeightSyncConfig = WeightSyncConfig()
    vllm: VLLMServerConfig = Field(
        VLLMServerConfig(max_model_len=8192, scheduling_policy="priority"),
        description="the loop's own vLLM server (rollout.server = 'embedded'); dev mode "
        "is always on",
    )
    world_size: PositiveInt = Field(
        1, description="trainer ranks: processes on CPU (gloo), GPUs on CUDA (nccl)"
    )
    eval: EvalConfig = Field(
        EvalConfig(), description="evaluation during training on held-apart tasks"
    )
    online: OnlineConfig | None = Field(
        None,
        description="libra train --online: serve the gateway to agents elsewhere and train "
        "on the sessions they end, with no task source of its own; None: off",
    )
    tracking: TrackingConfig = Field(
        TrackingConfig(), description="experiment trackers the run logs to (none: off)"
    )
    alloc: AllocConfig | None = Field(
        None,
        description="local workers moved between serving and training by the allocation "
        "loop (the trainer starts on alloc.training, not world_size); None: off",
    )

    @model_validator(mode="after")
    def _consistent(self) -> TrainRunConfig:
        owned = sorted(set(_LOOP_OWNED) & self.rollout.model_fields_set)
        if owned:
            raise ValueError(f"rollout.{', rollout.'.join(owned)}: the loop sets these per step")
        players = (self.rollout.env, self.rollout.envs, self.rollout.agent)
        if self.keep_best and not (
            self.eval.every
            and self.checkpoint_every
            and self.eval.every % self.checkpoint_every == 0
        ):
            raise ValueError(
                "keep_best keeps an evaluated checkpoint: eval.every must be a multiple of "
                "checkpoint_every (both set)"
            )
        agents = self.online is not None or self.rollout.agent is not None
        if self.eval.every and agents and self.eval.envs is None:
            raise ValueError("eval: agents play this run; name the envs to evaluate (eval.envs)")
        if self.online is not None:
            for key in ("agent", "envs", "tasks"):
                if getattr(self.rollout, key) is not None:
                    raise ValueError(f"online: agents elsewhere play; drop rollout.{key}")
        elif players == (None, None, None):
            raise ValueError(
                "name an env (rollout.env), a mixture (rollout.envs) or an agent (rollout.agent)"
            )
        if self.grpo.kl_coef > 0:
            raise ValueError("grpo.kl_coef > 0 needs a reference model, which the loop lacks")
        if self.allocating and self.server != "embedded":
            raise ValueError("alloc: the pool serves the run's own model: rollout.server=embedded")
        if self.sync.transport == "gloo" and (self.server != "embedded" or self.allocating):
            raise ValueError(
                "sync.transport=gloo broadcasts to the run's own vLLM: rollout.server=embedded, "
                "without [alloc] (elsewhere the weights go by disk)"
            )
        if self.sync.transport == "gloo" and self.trainer.lora.enabled:
            raise ValueError(
                "sync.transport=gloo sends whole weights; with trainer.lora each step sends "
                "the adapters alone, a few MB, by disk: drop one of the two"
            )
        return self

    @property
    def adapter_sync(self) -> bool:
        """Whether each step syncs the LoRA adapters alone: the run's own vLLM loads them
        at runtime; other servers (a URL, a gateway, the pool's) take merged weights."""
        return self.trainer.lora.enabled and self.server == "embedded" and not self.allocating

    @property
    def allocating(self) -> bool:
        return self.alloc is not None and self.alloc.enabled

    @property
    def ahead(self) -> int:
        return {"sync": 0, "one-step-off": 1, "async": self.max_ahead}[self.mode]

    @property
    def mixed(self) -> bool:
        return self.rollout.envs is not None and len(self.rollout.envs) > 1

    @property
    def server(self) -> str | None:
        return self.serve or self.rollout.server

    @property
    def reloads(self) -> bool:
        if self.reload_weights is not None:
            return self.reload_weights
        return self.server not in (None, "emulated")

    @property
    def trainer_temperature(self) -> float:
        """The temperature of the trainer's logprobs: that of the records' logprobs."""
        if self.logprobs_mode == "processed_logprobs" and self.server not in (None, "emulated"):
            return self.rollout.engine.sampling.temperature or 1.0
        return 1.0

    def to_toml(self) -> str:
        """The config as TOML that loads back to the same config."""
        return to_toml(
            self.model_dump(mode="json", exclude_none=True, exclude={"rollout": set(_LOOP_OWNED)})
        )


def to_toml(data: dict[str, Any]) -> str:
    """``data`` (JSON values, no None) as TOML: scalars first, then each table."""
    lines: list[str] = []
    _write_table(data, [], lines)
    return "\n".join(lines).lstrip("\n") + "\n"


def _write_table(data: dict[str, Any], path: list[str], lines: list[str]) -> None:
    tables = {key: value for key, value in data.items() if isinstance(value, dict) and value}
    scalars = {key: value for key, value in data.items() if key not in tables}
    if path and scalars:
        lines += ["", f"[{'.'.join(_key(part) for part in path)}]"]
    lines += [f"{_key(key)} = {_value(value)}" for key, value in scalars.items()]
    for key, value in tables.items():
        _write_table(value, [*path, key], lines)


def _key(key: str) -> str:
    bare = key.replace("_", "").replace("-", "").isalnum() and key.isascii()
    return key if bare else json.dumps(key)


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value) if value == value and abs(value) != float("inf") else "nan"
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, list):
        return "[" + ", ".join(_value(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_key(k)} = {_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"no TOML for {value!r}")
