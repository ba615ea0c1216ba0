"""Weights & Biases, through ``wandb``: the step's scalars and histograms, sampled
trajectories as a table, the config, checkpoints as artifacts by reference (the files
stay in the run folder).

W&B runs offline unless a key is set (``wandb_mode = "auto"``): the run folder under
``<dir>/wandb`` is what ``wandb sync`` uploads later. A resume continues the same run
online, from the resumed step (``resume_from``: what the killed run logged after it is
rewound); offline, W&B cannot continue a run, so the resume starts a new one under the
same name and group and says so in one line.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import wandb

from libra.tracking._protocol import RunStart, StepLog

_TABLE_COLUMNS = ["step", "id", "env", "status", "reward", "turns", "tokens", "conversation"]


class WandbTracker:
    name = "wandb"

    def __init__(self, start: RunStart, mode: str) -> None:
        online = mode == "online" or (mode == "auto" and bool(os.environ.get("WANDB_API_KEY")))
        (start.dir / "wandb").mkdir(parents=True, exist_ok=True)  # where wandb writes
        kwargs: dict[str, Any] = {
            "project": start.project,
            "name": start.name,
            "group": start.group,
            "tags": start.tags,
            "config": start.config,
            "dir": str(start.dir),
            "mode": "online" if online else "offline",
            # (no capture of the run's console: the trainer's own output stays as it is)
            "settings": wandb.Settings(console="off", quiet=True, x_disable_stats=True),
        }
        saved = start.saved_id("wandb")
        if start.resume_step is not None and saved is not None:
            if online:
                kwargs["resume_from"] = f"{saved}?_step={start.resume_step}"
            else:
                print(
                    f"wandb: offline runs cannot be continued: the resume from step "
                    f"{start.resume_step} starts a new run named {start.name!r} in group "
                    f"{start.group!r}",
                    file=sys.stderr,
                )
        self._run = wandb.init(**kwargs)
        start.save_id("wandb", self._run.id)

    def log(self, entry: StepLog) -> None:
        data: dict[str, Any] = dict(entry.scalars)
        for key, values in entry.histograms.items():
            if values:
                data[key] = wandb.Histogram(values)
        if entry.samples:
            rows = [
                [entry.step, s.id, s.env, s.status, s.reward, s.turns, s.tokens, s.text]
                for s in entry.samples
            ]
            data["samples"] = wandb.Table(columns=_TABLE_COLUMNS, data=rows)
        self._run.log(data, step=entry.step)

    def log_checkpoint(self, step: int, path: Path) -> None:
        artifact = wandb.Artifact(f"{self._run.name}-checkpoint", type="checkpoint")
        artifact.add_reference(path.resolve().as_uri(), checksum=False)
        self._run.log_artifact(artifact, aliases=[f"step-{step}", "latest"])

    def close(self) -> None:
        self._run.finish()
