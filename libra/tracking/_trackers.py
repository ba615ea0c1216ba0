"""The run's trackers, opened by name, each handed every figure; and how a metrics line
becomes scalars."""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Self

from libra.config import UsageError
from libra.tracking._config import EXTRAS, Backend, TrackingConfig
from libra.tracking._protocol import RunStart, StepLog, Tracker

#: The module each backend imports: missing, the backend's extra is not installed.
_MODULES: dict[Backend, str] = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}


def check_installed(config: TrackingConfig) -> None:
    """One clear line for each backend named but not installed, before the run starts."""
    for backend in config.backends:
        if importlib.util.find_spec(_MODULES[backend]) is None:
            raise UsageError(
                f"tracking.backends names {backend}, whose library is not installed: "
                f"pip install 'libra[{EXTRAS[backend]}]'"
            )


class Trackers:
    """Every backend of ``config``, opened for ``start`` (each imported only here, when
    named); a figure logged goes to all of them."""

    def __init__(self, config: TrackingConfig, start: RunStart) -> None:
        check_installed(config)
        start.dir.mkdir(parents=True, exist_ok=True)
        self.trackers: list[Tracker] = []
        for backend in dict.fromkeys(config.backends):
            self.trackers.append(_open(backend, config, start))

    def log(self, entry: StepLog) -> None:
        for tracker in self.trackers:
            tracker.log(entry)

    def log_checkpoint(self, step: int, path: Path) -> None:
        for tracker in self.trackers:
            tracker.log_checkpoint(step, path)

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _open(backend: Backend, config: TrackingConfig, start: RunStart) -> Tracker:
    if backend == "tensorboard":
        from libra.tracking._tensorboard import TensorBoardTracker

        return TensorBoardTracker(start)
    if backend == "wandb":
        from libra.tracking._wandb import WandbTracker

        return WandbTracker(start, config.wandb_mode)
    from libra.tracking._mlflow import MLflowTracker

    return MLflowTracker(start, config.mlflow_uri)


def scalars(line: Mapping[str, object], prefix: str = "") -> dict[str, float]:
    """A metrics line's numbers by path (``loss/pg``, ``statuses/ok``,
    ``envs/quiz/reward_mean``, ``alloc/train_workers``); booleans as 0 or 1; text and
    missing values (None) are not figures, and are left out."""
    found: dict[str, float] = {}
    for key, value in line.items():
        if isinstance(value, Mapping):
            found |= scalars(value, f"{prefix}{key}/")
        elif isinstance(value, bool | int | float):
            found[f"{prefix}{key}"] = float(value)
    return found
