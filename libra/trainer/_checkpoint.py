"""Checkpoints of a training run, written atomically, and resuming from the latest one.

A checkpoint is a folder ``<run_dir>/checkpoints/step-<NNNNNNNN>/`` holding:

- ``trainer/``: the sharded model and optimizer state, written by every rank with
  ``torch.distributed.checkpoint`` (DCP), so a run resumes on any number of ranks;
- ``trainer.pt``: the LR schedule's state and the trainer's step count (rank 0);
- ``rng/rank<r>.pt``: each rank's python and torch random states;
- ``run.json``: the run's side: steps done, the data position (the next task's index),
  the weight version the servers hold, and the length of the metrics file then;
- ``prefix_forest.json``: the scheduler's prefix forest, when the run has one.

Every file is first written under ``.partial-step-<NNNNNNNN>/`` and the folder is renamed
to its final name only once all of them are on disk: a run killed mid-write leaves the
previous checkpoint whole, and :func:`find_latest` never sees a partial one.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from libra.trainer._fsdp import FSDPTrainer

__all__ = [
    "Checkpoint",
    "LoadCheckpoint",
    "Persistent",
    "RestoreCheckpoint",
    "RunState",
    "WriteCheckpoint",
    "checkpoint_dir",
    "find_latest",
    "load_trainer_state",
    "mark_best",
    "read_best",
    "resume",
    "save_trainer_state",
    "truncate_metrics",
]

CHECKPOINTS = "checkpoints"
_FINAL = re.compile(r"^step-(\d{8})$")
_PARTIAL_PREFIX = ".partial-"
_RUN_FILE = "run.json"
_FOREST_FILE = "prefix_forest.json"
_BEST_FILE = "best.json"
_TRAINER_FILE = "trainer.pt"
_SHARDS = "trainer"
_RNG = "rng"


class Persistent(Protocol):
    """What saves itself to a file: the scheduler's prefix forest (``PrefixForest``)."""

    def save(self, path: str | Path) -> None: ...


@dataclass(frozen=True, slots=True)
class RunState:
    """The run's side of a checkpoint: where the loop stands, apart from the model."""

    step: int  # optimizer steps done: the next step's index
    next_task: int  # the data position: index of the next task the sampler hands out
    weight_version: int  # the version of the weights the servers hold
    metrics_bytes: int = 0  # the metrics file's length when the checkpoint was taken
    extra: dict[str, Any] = field(default_factory=dict)  # anything else JSON the loop keeps

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> RunState:
        return cls(**json.loads(text))


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """One checkpoint on disk: its folder and the run's state in it."""

    path: Path
    run: RunState

    @property
    def forest_path(self) -> Path | None:
        """The saved prefix forest (``PrefixForest.load(path)``), if the run had one."""
        path = self.path / _FOREST_FILE
        return path if path.exists() else None

    @classmethod
    def read(cls, path: str | Path) -> Checkpoint:
        path = Path(path)
        return cls(path, RunState.from_json((path / _RUN_FILE).read_text()))

    @classmethod
    def write(
        cls,
        run_dir: str | Path,
        trainer: FSDPTrainer,
        run: RunState,
        *,
        forest: Persistent | None = None,
        keep_last: int = 3,
    ) -> Checkpoint:
        """Write a checkpoint of ``trainer`` and ``run`` (collective: every rank calls it),
        then delete all but the ``keep_last`` newest. Rank 0 writes the run's files."""
        import torch.distributed as dist

        if keep_last < 1:
            raise ValueError(f"keep_last must be at least 1, not {keep_last}")
        root = checkpoint_dir(run_dir)
        final = checkpoint_path(run_dir, run.step)
        partial = root / f"{_PARTIAL_PREFIX}{final.name}"
        main = trainer.dist.is_main
        if main:
            _remove_partials(root)  # left by a run killed mid-write
            partial.mkdir(parents=True)
        dist.barrier()
        save_trainer_state(trainer, partial)
        dist.barrier()
        if main:
            (partial / _RUN_FILE).write_text(run.to_json())
            if forest is not None:
                forest.save(partial / _FOREST_FILE)
            _publish(partial, final)
            _prune(root, keep_last)
        dist.barrier()
        return cls(final, run)

    def restore(self, trainer: FSDPTrainer) -> RunState:
        """Load the trainer's state from this checkpoint (collective); the run's state."""
        load_trainer_state(trainer, self.path)
        return self.run


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINTS


def checkpoint_path(run_dir: str | Path, step: int) -> Path:
    """The folder of the checkpoint after ``step`` steps (complete or not, or none)."""
    return checkpoint_dir(run_dir) / f"step-{step:08d}"


def find_latest(run_dir: str | Path) -> Checkpoint | None:
    """The newest complete checkpoint of the run, or None (partial folders are skipped)."""
    folders = _complete(checkpoint_dir(run_dir))
    return Checkpoint.read(folders[-1]) if folders else None


def resume(run_dir: str | Path, trainer: FSDPTrainer) -> RunState | None:
    """The one call a loop makes on ``--resume``: restore ``trainer`` from the newest
    checkpoint (collective) and return the run's state, or None where there is none.

    The metrics file ``<run_dir>/metrics.jsonl`` is cut back to its length at that
    checkpoint (rank 0), so steps logged after it are logged once, when they run again.
    """
    import torch.distributed as dist

    latest = find_latest(run_dir)
    if latest is None:
        return None
    state = latest.restore(trainer)
    if trainer.dist.is_main:
        truncate_metrics(Path(run_dir) / "metrics.jsonl", state.metrics_bytes)
    dist.barrier()
    return state


def truncate_metrics(path: Path, length: int) -> None:
    """Cut ``path`` back to ``length`` bytes (what it held at the checkpoint)."""
    if not path.exists():
        return
    if path.stat().st_size < length:
        raise ValueError(f"{path} is shorter than the {length} bytes the checkpoint saw")
    with path.open("r+b") as file:
        file.truncate(length)
        file.flush()
        os.fsync(file.fileno())


# -------------------------------------------------------------------- trainer state


def save_trainer_state(trainer: FSDPTrainer, folder: str | Path) -> None:
    """Write the sharded model and optimizer (DCP), the LR schedule and step count, and
    this rank's RNG states under ``folder`` (collective)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    folder = Path(folder)
    # Before the first step AdamW has no state; asking DCP for it would make one by
    # stepping with zero gradients, which changes the next real step's bias correction.
    with_optimizer = bool(trainer.optimizer.state)
    model_state, optimizer_state = get_state_dict(
        trainer.model, trainer.optimizer if with_optimizer else []
    )
    shards: dict[str, Any] = {"model": model_state}
    if with_optimizer:
        shards["optimizer"] = optimizer_state
    dcp.save(shards, checkpoint_id=folder / _SHARDS)
    if trainer.dist.is_main:
        _save_synced(
            {
                "lr_schedule": trainer.lr_schedule.state_dict(),
                "steps_done": trainer.steps_done,
                "with_optimizer": with_optimizer,
                "world_size": trainer.dist.world_size,
            },
            folder / _TRAINER_FILE,
        )
    rng = folder / _RNG
    rng.mkdir(exist_ok=True)
    _save_synced(_rng_state(torch), rng / f"rank{trainer.dist.rank}.pt")


def load_trainer_state(trainer: FSDPTrainer, folder: str | Path) -> None:
    """Restore what :func:`save_trainer_state` wrote (collective). The RNG states are
    this rank's where the world size is unchanged, else rank 0's on every rank."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    folder = Path(folder)
    meta = torch.load(folder / _TRAINER_FILE, weights_only=True)
    with_optimizer: bool = meta["with_optimizer"]
    optimizers = trainer.optimizer if with_optimizer else []
    model_state, optimizer_state = get_state_dict(trainer.model, optimizers)
    shards: dict[str, Any] = {"model": model_state}
    if with_optimizer:
        shards["optimizer"] = optimizer_state
    dcp.load(shards, checkpoint_id=folder / _SHARDS)
    set_state_dict(
        trainer.model,
        optimizers,
        model_state_dict=shards["model"],
        optim_state_dict=shards.get("optimizer", {}),
    )
    trainer.lr_schedule.load_state_dict(meta["lr_schedule"])
    trainer.steps_done = int(meta["steps_done"])
    same_world = int(meta["world_size"]) == trainer.dist.world_size
    rank = trainer.dist.rank if same_world else 0
    _set_rng_state(torch, torch.load(folder / _RNG / f"rank{rank}.pt", weights_only=True))


def _rng_state(torch: Any) -> dict[str, Any]:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(torch: Any, state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _save_synced(value: Any, path: Path) -> None:
    import torch

    with path.open("wb") as file:
        torch.save(value, file)
        file.flush()
        os.fsync(file.fileno())


# ------------------------------------------------------------------------ folders


def _publish(partial: Path, final: Path) -> None:
    """Flush every file of ``partial`` to disk, then rename it to ``final`` atomically."""
    for path in sorted(partial.rglob("*"), reverse=True):
        _fsync(path)
    _fsync(partial)
    if final.exists():  # the same step saved again (a rerun of it after a resume)
        shutil.rmtree(final)
    os.replace(partial, final)
    _fsync(final.parent)


def _fsync(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _complete(root: Path) -> list[Path]:
    """The complete checkpoints under ``root``, oldest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _FINAL.match(p.name))]
    return [path for _, path in sorted(found)]


def _remove_partials(root: Path) -> None:
    if root.is_dir():
        for partial in root.glob(f"{_PARTIAL_PREFIX}*"):
            shutil.rmtree(partial)


def _prune(root: Path, keep_last: int) -> None:
    best = read_best(root.parent)
    spared = checkpoint_path(root.parent, best["step"]).name if best else None
    for old in _complete(root)[:-keep_last]:
        if old.name != spared:
            shutil.rmtree(old)


def mark_best(run_dir: str | Path, step: int, metric: str, value: float) -> None:
    """Keep checkpoint ``step`` beside the ``keep_last`` newest from now on: its
    evaluation scored ``value`` on ``metric``, the best so far (``checkpoints/best.json``,
    replaced atomically). The checkpoint it spared before may go at the next prune."""
    root = checkpoint_dir(run_dir)
    partial = root / f".{_BEST_FILE}.tmp"  # (not a .partial- folder: those are swept)
    partial.write_text(json.dumps({"step": step, "metric": metric, "value": value}))
    os.replace(partial, root / _BEST_FILE)


def read_best(run_dir: str | Path) -> dict[str, Any] | None:
    """What :func:`mark_best` last kept: ``step``, ``metric`` and ``value``; or None."""
    path = checkpoint_dir(run_dir) / _BEST_FILE
    return json.loads(path.read_text()) if path.exists() else None


# ------------------------------------------------- commands for the trainer's processes


@dataclass(frozen=True, slots=True)
class WriteCheckpoint:
    """A command every rank of a trainer process runs: write a checkpoint of the trainer
    and ``state`` (and ``forest``, pickled across from the loop) under ``run_dir``."""

    run_dir: Path
    state: RunState
    forest: Persistent | None = None
    keep_last: int = 3

    def run(self, trainer: FSDPTrainer) -> Path:
        checkpoint = Checkpoint.write(
            self.run_dir, trainer, self.state, forest=self.forest, keep_last=self.keep_last
        )
        return checkpoint.path


@dataclass(frozen=True, slots=True)
class LoadCheckpoint:
    """A command every rank of a trainer process runs: load the checkpoint at ``path``
    (the run goes nowhere from it: ``libra eval``); the run's state then."""

    path: Path

    def run(self, trainer: FSDPTrainer) -> RunState:
        return Checkpoint.read(self.path).restore(trainer)


@dataclass(frozen=True, slots=True)
class RestoreCheckpoint:
    """A command every rank of a trainer process runs: :func:`resume` from ``run_dir``'s
    newest checkpoint; the run's state, or None where there is none."""

    run_dir: Path

    def run(self, trainer: FSDPTrainer) -> RunState | None:
        return resume(self.run_dir, trainer)
