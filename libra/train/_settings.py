"""What the RL loop reads of ``libra train``'s config (``libra.launch.TrainRunConfig``)."""

from __future__ import annotations

from typing import Literal, Protocol

from libra.serving import WeightSyncConfig
from libra.trainer import GRPOConfig, TrainConfig

Mode = Literal["sync", "one-step-off", "async"]


class RunSettings(Protocol):
    """The loop's settings: the steps, their groups and how the weights move between
    trainer and servers. ``libra.launch.TrainRunConfig`` is one; the loop reads nothing
    of how the run was assembled."""

    @property
    def steps(self) -> int: ...

    @property
    def prompts_per_step(self) -> int: ...

    @property
    def samples_per_prompt(self) -> int: ...

    @property
    def mode(self) -> Mode: ...

    @property
    def ahead(self) -> int:
        """Steps whose rollouts run while a step trains: 0 (sync), 1 (one-step-off) or
        ``max_ahead`` (async)."""
        ...

    @property
    def seed(self) -> int: ...

    @property
    def mixed(self) -> bool:
        """Whether the steps draw their prompts from more than one env."""
        ...

    @property
    def checkpoint_every(self) -> int: ...

    @property
    def keep_last(self) -> int: ...

    @property
    def keep_best(self) -> str | None:
        """``eval/<env>/<figure>``: the checkpoint that scored highest on it is kept."""
        ...

    @property
    def export_dtype(self) -> str | None: ...

    @property
    def adapter_sync(self) -> bool:
        """Whether each version is the trainer's LoRA adapters alone (else whole weights)."""
        ...

    @property
    def grpo(self) -> GRPOConfig: ...

    @property
    def train(self) -> TrainConfig: ...

    @property
    def sync(self) -> WeightSyncConfig: ...

    @property
    def reloads(self) -> bool:
        """Whether each new version is loaded into the servers (else: versions only)."""
        ...

    @property
    def trainer_temperature(self) -> float:
        """The temperature of the trainer's logprobs: that of the records' logprobs."""
        ...
