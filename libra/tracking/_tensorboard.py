"""TensorBoard, through torch's ``SummaryWriter``: scalars, histograms, sampled
trajectories as text, the config as text. A resume opens the writer with
``purge_step``: TensorBoard then drops what the killed run logged from that step on."""

from __future__ import annotations

from pathlib import Path

import numpy
from torch.utils.tensorboard import SummaryWriter

from libra.tracking._protocol import RunStart, StepLog


class TensorBoardTracker:
    name = "tensorboard"

    def __init__(self, start: RunStart) -> None:
        self.log_dir = start.dir / "tensorboard"
        self._writer = SummaryWriter(str(self.log_dir), purge_step=start.resume_step)
        step = start.resume_step or 0
        self._writer.add_text("config", _code(start.config_toml), step)

    def log(self, entry: StepLog) -> None:
        for key, value in entry.scalars.items():
            self._writer.add_scalar(key, value, entry.step)
        for key, values in entry.histograms.items():
            if values:
                self._writer.add_histogram(key, numpy.asarray(values), entry.step)
        if entry.samples:
            text = "\n\n---\n\n".join(sample.markdown() for sample in entry.samples)
            self._writer.add_text("samples", text, entry.step)
        self._writer.flush()

    def log_checkpoint(self, step: int, path: Path) -> None:
        self._writer.add_text("checkpoints", f"after {step} steps: `{path}`", step)

    def close(self) -> None:
        self._writer.close()


def _code(text: str) -> str:
    """Markdown that TensorBoard shows as written (4-space indent: a code block)."""
    return "\n".join("    " + line for line in text.splitlines())
