"""MLflow, through its client: the step's scalars (as metrics), the config (as params
and ``config.toml``), sampled trajectories as text artifacts, checkpoints as small JSON
artifacts pointing at their folders (MLflow has no reference artifacts; the files stay
in the run folder). By default on a SQLite store in the tracking dir. MLflow has no
histogram type: it gets the step's means and spreads, not the histograms. A figure's
name keeps its path, but for the characters MLflow refuses (``pass@1`` is ``pass_at_1``).

A resume continues the same MLflow run. MLflow cannot take a metric back, so steps the
killed run already logged (it wrote their lines after its last checkpoint) are not
logged again: they keep the killed run's figures, and the resume says so in one line.
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path
from typing import Any

from mlflow import MlflowClient
from mlflow.entities import Metric, Param

from libra.tracking._protocol import RunStart, StepLog

_MARKERS = ("weight_version", "eval/weight_version")  # one in every step's and eval's line
_BATCH = 900  # MLflow takes at most 1,000 metrics a batch


class MLflowTracker:
    name = "mlflow"

    def __init__(self, start: RunStart, uri: str | None) -> None:
        start.dir.mkdir(parents=True, exist_ok=True)
        self.uri = uri or f"sqlite:///{(start.dir / 'mlflow.db').resolve()}"
        self.client = MlflowClient(tracking_uri=self.uri)
        saved = start.saved_id("mlflow")
        #: per marker, the newest step the tracked run holds: not logged again
        self._logged: dict[str, int] = {}
        if start.resume_step is not None and saved is not None:
            self.run_id = saved
            self.client.update_run(saved, status="RUNNING")
            for marker in _MARKERS:
                history = self.client.get_metric_history(saved, marker)
                if history:
                    self._logged[marker] = max(metric.step for metric in history)
            if any(step >= start.resume_step for step in self._logged.values()):
                print(
                    f"mlflow: the killed run logged steps from {start.resume_step} on; "
                    "MLflow cannot take metrics back, so those steps keep its figures "
                    "(metrics.jsonl holds the resumed run's)",
                    file=sys.stderr,
                )
        else:
            self.run_id = self._create(start)
        start.save_id("mlflow", self.run_id, uri=self.uri)

    def _create(self, start: RunStart) -> str:
        experiment = self.client.get_experiment_by_name(start.project)
        if experiment is None:
            experiment_id = self.client.create_experiment(
                start.project, artifact_location=(start.dir / "mlartifacts").resolve().as_uri()
            )
        else:
            experiment_id = experiment.experiment_id
        tags = {tag: "" for tag in start.tags} | {"libra.group": start.group}
        run = self.client.create_run(experiment_id, run_name=start.name, tags=tags)
        params = [Param(key, str(value)[:6000]) for key, value in _flat(start.config).items()]
        for first in range(0, len(params), 100):  # MLflow takes 100 params a batch
            self.client.log_batch(run.info.run_id, params=params[first : first + 100])
        self.client.log_text(run.info.run_id, start.config_toml, "config.toml")
        return str(run.info.run_id)

    def log(self, entry: StepLog) -> None:
        marker = next((m for m in _MARKERS if m in entry.scalars), None)
        if marker is not None and entry.step <= self._logged.get(marker, -1):
            return  # the killed run logged this step: MLflow keeps its figures
        now = int(time.time() * 1000)
        metrics = [
            Metric(_name(key), value, now, entry.step) for key, value in entry.scalars.items()
        ]
        for first in range(0, len(metrics), _BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[first : first + _BATCH])
        if entry.samples:
            text = "\n\n---\n\n".join(sample.markdown() for sample in entry.samples)
            prefix = "eval-samples" if marker == "eval/weight_version" else "samples"
            self.client.log_text(self.run_id, text, f"{prefix}/step-{entry.step}.md")

    def log_checkpoint(self, step: int, path: Path) -> None:
        pointer = {"step": step, "path": str(path.resolve())}
        self.client.log_dict(self.run_id, pointer, f"checkpoints/step-{step}.json")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _name(key: str) -> str:
    """A metric name MLflow takes: ``pass@1`` as ``pass_at_1``, any other character it
    refuses as ``_`` (it takes letters, digits and ``_-. :/``)."""
    return re.sub(r"[^\w\-. :/]", "_", key.replace("@", "_at_"))


def _flat(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` as ``{"a.b": 1}``: MLflow's params are flat."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat |= _flat(value, f"{prefix}{key}.")
        elif value is not None:
            flat[f"{prefix}{key}"] = value
    return flat
