"""Checkpoints: a resumed trainer steps as if never stopped, a run killed mid-write keeps
its previous checkpoint, the last K are kept, and a killed run continues without a gap."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from libra.sched.policies import PrefixForest
from libra.trainer import (
    Checkpoint,
    FSDPTrainer,
    RunState,
    TrainerConfig,
    find_latest,
    spawn,
    truncate_metrics,
)
from tests.trainer._ranks import (
    MicroBatch,
    fixed_batch,
    masked_token_nll,
    save_llama,
    save_tiny_llama,
)

ROOT = Path(__file__).resolve().parents[2]
_RENDEZVOUS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def group_of_one() -> Iterator[None]:
    """A trainer in this process joins a process group of one: leave none behind."""
    import torch.distributed as dist

    before = {key: os.environ.get(key) for key in _RENDEZVOUS}
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
    for key, value in before.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_a_resumed_trainer_steps_as_if_never_stopped(tmp_path: Path, world: int) -> None:
    model_dir = save_tiny_llama(tmp_path / "tiny")
    batch = fixed_batch(64, sequences=4, length=16)
    # Warmup makes the lr differ per step, the noisy loss draws from both RNGs per rank.
    config = TrainerConfig(lr=1e-2, warmup_steps=4, backend="gloo", cpu_threads=1)
    saved = tmp_path / "saved"

    straight = spawn(world, steps_then_checkpoint, model_dir, batch, config, 3, None, None)
    spawn(world, steps_then_checkpoint, model_dir, batch, config, 1, None, saved)
    resumed = spawn(world, steps_then_checkpoint, model_dir, batch, config, 2, saved, None)

    for whole, tail in zip(straight, resumed, strict=True):
        assert tail["steps_done"] == whole["steps_done"] == 3
        assert tail["lrs"] == whole["lrs"][1:]
        assert tail["losses"] == pytest.approx(whole["losses"][1:], rel=1e-6)
        for name, value in whole["parameters"].items():
            assert torch.allclose(tail["parameters"][name], value, rtol=1e-5, atol=1e-7), name
    # The two ranks draw different noise, so each rank's own RNG state came back.
    if world == 2:
        assert straight[0]["losses"] == straight[1]["losses"]  # averaged over ranks
        assert set((saved / "rng").iterdir()) == {
            saved / "rng" / "rank0.pt",
            saved / "rng" / "rank1.pt",
        }
        a, b = (torch.load(saved / "rng" / f"rank{r}.pt")["torch"] for r in (0, 1))
        assert not torch.equal(a, b)


@pytest.mark.slow
@pytest.mark.usefixtures("group_of_one")
def test_a_run_killed_mid_write_keeps_its_previous_checkpoint(tmp_path: Path) -> None:
    # Big enough that writing it takes a while: the kill lands inside a write.
    model_dir = save_llama(tmp_path / "model", hidden=256, layers=4)
    run_dir = tmp_path / "run"
    victim = _python(f"checkpoint_forever(Path({str(model_dir)!r}), Path({str(run_dir)!r}))")
    try:
        partial = _wait_for_partial_after_first(run_dir / "checkpoints")
        victim.send_signal(signal.SIGKILL)
    finally:
        victim.kill()
        victim.wait()

    assert partial.exists()  # killed before the rename
    latest = find_latest(run_dir)
    assert latest is not None and latest.path.name == f"step-{latest.run.step:08d}"
    assert partial.name == f".partial-step-{latest.run.step + 1:08d}"
    assert latest.run == RunState(latest.run.step, 2 * latest.run.step, latest.run.step)
    trainer = FSDPTrainer(model_dir, TrainerConfig(cpu_threads=1, backend="gloo"))
    trainer.load_checkpoint(latest.path)
    assert trainer.steps_done == latest.run.step
    # The next write clears the half-written folder.
    Checkpoint.write(run_dir, trainer, RunState(latest.run.step + 1, 0, 0))
    assert not partial.exists()


@pytest.mark.slow
@pytest.mark.usefixtures("group_of_one")
def test_only_the_last_k_checkpoints_are_kept(tmp_path: Path) -> None:
    trainer = FSDPTrainer(save_tiny_llama(tmp_path / "tiny"), TrainerConfig(backend="gloo"))
    forest = PrefixForest()
    forest.observe("p", ["write"], [12, 5])
    for step in range(1, 6):
        Checkpoint.write(
            tmp_path, trainer, RunState(step, 4 * step, step), forest=forest, keep_last=2
        )

    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["step-00000004", "step-00000005"]
    latest = find_latest(tmp_path)
    assert latest is not None and latest.run == RunState(5, 20, 5)
    assert latest.forest_path is not None
    assert PrefixForest.load(latest.forest_path).to_bytes() == forest.to_bytes()
    assert find_latest(tmp_path / "elsewhere") is None
    with pytest.raises(ValueError, match="keep_last"):
        Checkpoint.write(tmp_path, trainer, RunState(6, 0, 0), keep_last=0)


@pytest.mark.slow
def test_a_run_killed_mid_step_continues_in_the_same_order_without_a_gap(
    tmp_path: Path,
) -> None:
    model_dir = save_llama(tmp_path / "model", hidden=128, layers=2)
    steps = 8
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    for run_dir in (straight, killed):
        run_dir.mkdir()
    assert _python(_run_call(model_dir, straight, steps, resume=False)).wait(timeout=300) == 0

    victim = _python(_run_call(model_dir, killed, steps, resume=False))
    try:
        # Steps 0..2 logged, the checkpoint holds 2 steps: step 3 is running now.
        _wait_for(lambda: len(_lines(killed / "metrics.jsonl")) >= 3)
        victim.send_signal(signal.SIGKILL)
    finally:
        victim.kill()
        victim.wait()
    logged_when_killed = _lines(killed / "metrics.jsonl")
    assert 3 <= len(logged_when_killed) < steps
    assert _python(_run_call(model_dir, killed, steps, resume=True)).wait(timeout=300) == 0

    whole, continued = _lines(straight / "metrics.jsonl"), _lines(killed / "metrics.jsonl")
    assert [m["step"] for m in continued] == list(range(steps))
    assert [m["tasks"] for m in continued] == [m["tasks"] for m in whole]
    assert [m["loss"] for m in continued] == pytest.approx([m["loss"] for m in whole], rel=1e-6)
    latest = find_latest(killed)
    assert latest is not None and latest.run.step == steps and latest.run.next_task == 2 * steps


def test_truncating_metrics_cuts_back_to_the_checkpoint(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 0}\n{"step": 1}\n')
    truncate_metrics(metrics, len('{"step": 0}\n'))
    assert metrics.read_text() == '{"step": 0}\n'
    with pytest.raises(ValueError, match="shorter"):
        truncate_metrics(metrics, 100)
    truncate_metrics(tmp_path / "absent.jsonl", 0)
    assert not (tmp_path / "absent.jsonl").exists()


def test_run_state_round_trips_through_json() -> None:
    state = RunState(3, 12, 2, 340, {"sampler": "seeds"})
    assert RunState.from_json(state.to_json()) == state


# ------------------------------------------------------ what the spawned ranks run


def noisy_nll(model: nn.Module, batch: MicroBatch) -> torch.Tensor:
    """The masked token mean NLL over a random half of the tokens, times a random scale:
    a step's result depends on the torch and python random states."""
    import random

    keep = (torch.rand(batch.mask.shape) < 0.5).float() * batch.mask
    scale = 0.5 + random.random()
    return masked_token_nll(model, MicroBatch(batch.ids, keep), scale / float(keep.sum() + 1))


def steps_then_checkpoint(
    model_dir: Path,
    batch: MicroBatch,
    config: TrainerConfig,
    steps: int,
    load_from: Path | None,
    save_to: Path | None,
) -> dict[str, Any]:
    """Seed this rank, restore ``load_from`` if given, take ``steps`` steps on this rank's
    rows of ``batch``, save to ``save_to`` if given: the losses, lrs, final parameters."""
    import random

    trainer = FSDPTrainer(model_dir, config)
    rank, world = trainer.dist.rank, trainer.dist.world_size
    torch.manual_seed(100 + rank)
    random.seed(200 + rank)
    if load_from is not None:
        trainer.load_checkpoint(load_from)
    mine = [
        MicroBatch(batch.ids[i : i + 1], batch.mask[i : i + 1])
        for i in range(rank, len(batch.ids), world)
    ]
    metrics = [trainer.step(mine, noisy_nll) for _ in range(steps)]
    if save_to is not None:
        trainer.save_checkpoint(save_to)
    return {
        "losses": [m.loss for m in metrics],
        "lrs": [m.lr for m in metrics],
        "steps_done": trainer.steps_done,
        "parameters": trainer.full_parameters(),
    }


def task_seed(index: int, seed: int = 7) -> int:
    """The task stream of the run: task ``index``'s seed (the order a sampler hands out)."""
    import zlib

    return zlib.crc32(f"{seed}/{index}".encode())


def task_batch(seeds: Sequence[int], vocab: int, length: int) -> MicroBatch:
    """One sequence of ids per task, drawn from its seed: the rollout's stand-in."""
    rows = [fixed_batch(vocab, 1, length, seed=s) for s in seeds]
    return MicroBatch(torch.cat([r.ids for r in rows]), torch.cat([r.mask for r in rows]))


def checkpointed_run(model_dir: Path, run_dir: Path, steps: int, resume_run: bool) -> None:
    """A training loop with the checkpoint hooks a run makes: resume, then per step take
    the next two tasks, train, log a metrics line, observe the prefix forest, and
    checkpoint every second step. One rank, in this process."""
    import json
    import random

    from libra.sched.policies import PrefixForest
    from libra.trainer import RestoreCheckpoint, RunState, WriteCheckpoint, find_latest

    trainer = FSDPTrainer(model_dir, TrainerConfig(lr=1e-2, cpu_threads=1, backend="gloo"))
    torch.manual_seed(0)  # the run's seed; a resumed run continues from the saved states
    random.seed(0)
    state = RestoreCheckpoint(run_dir).run(trainer) if resume_run else None
    step, next_task = (state.step, state.next_task) if state else (0, 0)
    latest = find_latest(run_dir) if state else None
    forest_path = latest.forest_path if latest else None
    forest = PrefixForest.load(forest_path) if forest_path else PrefixForest()
    metrics = run_dir / "metrics.jsonl"
    while step < steps:
        seeds = [task_seed(next_task + i) for i in range(2)]
        result = trainer.step([task_batch(seeds, 64, 24)], noisy_nll)
        forest.observe(f"p{step}", ["write", "run"], [30 - step, 10, 5])
        with metrics.open("a") as file:
            file.write(json.dumps({"step": step, "tasks": seeds, "loss": result.loss}) + "\n")
        step, next_task = step + 1, next_task + len(seeds)
        if step % 2 == 0:
            run = RunState(step, next_task, step, metrics.stat().st_size)
            WriteCheckpoint(run_dir, run, forest, keep_last=2).run(trainer)


def checkpoint_forever(model_dir: Path, run_dir: Path) -> None:
    """Step and checkpoint until killed: the victim of the atomicity test."""
    from libra.trainer import Checkpoint, RunState

    trainer = FSDPTrainer(model_dir, TrainerConfig(lr=1e-3, cpu_threads=1, backend="gloo"))
    batch = fixed_batch(64, sequences=2, length=16)
    step = 0
    while True:
        trainer.step([batch], noisy_nll)
        step += 1
        Checkpoint.write(run_dir, trainer, RunState(step, 2 * step, step), keep_last=2)


# ------------------------------------------------------------------------ helpers


def _python(call: str) -> subprocess.Popen[bytes]:
    code = f"from pathlib import Path\nfrom tests.trainer.test_checkpoint import *\n{call}\n"
    env = {k: v for k, v in os.environ.items() if k not in _RENDEZVOUS}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env)


def _run_call(model_dir: Path, run_dir: Path, steps: int, *, resume: bool) -> str:
    return f"checkpointed_run(Path({str(model_dir)!r}), Path({str(run_dir)!r}), {steps}, {resume})"


def _lines(path: Path) -> list[dict[str, object]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def _wait_for(condition: object, timeout: float = 120.0) -> None:
    assert callable(condition)
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("the run never got there")
        time.sleep(0.002)


def _wait_for_partial_after_first(root: Path) -> Path:
    """The half-written folder of a checkpoint, once one complete checkpoint exists and
    the DCP shards of the next are being written."""
    _wait_for(lambda: any(p.name.startswith("step-") for p in _listing(root)))
    found: list[Path] = []

    def writing() -> bool:
        found[:] = [
            p for p in _listing(root) if p.name.startswith(".partial-") and (p / "trainer").exists()
        ]
        return bool(found)

    _wait_for(writing)
    return found[0]


def _listing(root: Path) -> list[Path]:
    try:
        return list(root.iterdir())
    except FileNotFoundError:
        return []
