"""``[tracking]``: which experiment trackers a run logs to, and under which names."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, NonNegativeInt

from libra.config import Section

Backend = Literal["tensorboard", "wandb", "mlflow"]

#: The extra that installs each backend's library (``pip install 'libra[EXTRA]'``).
EXTRAS: dict[Backend, str] = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}


class TrackingConfig(Section):
    """Experiment tracking through the trackers' own libraries, each an optional extra."""

    backends: list[Backend] = Field(
        default_factory=list,
        description="tensorboard, wandb, mlflow: each logs every step's line, reward and "
        "length histograms, sampled trajectories, the config and checkpoints",
    )
    project: str = Field("libra", description="the W&B project, the MLflow experiment")
    run_name: str | None = Field(None, description="the tracked run's name; None: the run folder's")
    group: str | None = Field(None, description="the W&B group (an MLflow tag); None: the run name")
    tags: list[str] = Field(default_factory=list, description="tags of the tracked run")
    dir: Path | None = Field(
        None,
        description="where the trackers write (tensorboard/, wandb/, mlflow.db); None: "
        "<run_dir>/tracking",
    )
    samples: NonNegativeInt = Field(
        4, description="trajectories logged as text each step, spread over the rewards"
    )
    wandb_mode: Literal["auto", "online", "offline"] = Field(
        "auto", description="auto: online when a W&B key is set (WANDB_API_KEY), else offline"
    )
    mlflow_uri: str | None = Field(
        None, description="the MLflow tracking URI; None: a SQLite store, <dir>/mlflow.db"
    )
