"""The FSDP2 trainer: 2 gloo ranks compute the gradients one process computes; spawned
ranks die with the process that started them, one killed by a fatal signal says where,
and what a finished rank built is freed while its group is alive."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from libra.trainer import FSDPTrainer, TrainerConfig, export_weights, spawn, split_by_tokens
from tests.trainer._ranks import (
    MicroBatch,
    abort_on_rank_one,
    cycle_left_behind,
    fixed_batch,
    masked_token_nll,
    save_tiny_llama,
)

VOCAB = 49152  # SmolLM2's


# What each rank runs lives at module level: spawned processes import it.


def rank_gradients(
    model_dir: Path, batch: MicroBatch, config: TrainerConfig, run_dir: Path
) -> list[tuple[dict[str, torch.Tensor], float, Path]]:
    """This rank's share of ``batch``, one sequence per micro-batch: full gradients, loss,
    and the weights exported (unchanged: no step is taken) from the sharded model; with
    the LM head in one pass, then in chunks of 16 positions.

    The loss is scaled so that FSDP's mean over ranks and the trainer's mean over
    micro-batches give the masked token mean over the whole batch.
    """
    trainer = FSDPTrainer(model_dir, config)
    rank, world = trainer.dist.rank, trainer.dist.world_size
    mine = range(rank, len(batch.ids), world)
    micro = [MicroBatch(batch.ids[i : i + 1], batch.mask[i : i + 1]) for i in mine]
    scale = world * len(micro) / float(batch.mask.sum())
    results = []
    for chunk in (None, 16):
        loss_fn = partial(masked_token_nll, scale=scale, chunk_tokens=chunk)
        loss = trainer.accumulate(micro, loss_fn)
        results.append((trainer.full_gradients(), loss))
        trainer.optimizer.zero_grad(set_to_none=True)
    folder = export_weights(trainer, run_dir, version=0)
    return [(grads, loss, folder) for grads, loss in results]


def reference_gradients(
    model_dir: Path, batch: MicroBatch
) -> tuple[dict[str, torch.Tensor], float]:
    """The same loss on one process, without FSDP, the whole batch at once."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    loss = masked_token_nll(model, batch, 1.0 / float(batch.mask.sum()))
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return grads, float(loss.detach())


def checkpointing_and_steps(model_dir: Path, batch: MicroBatch) -> dict[str, Any]:
    """Gradients with and without activation checkpointing, then three warmup steps."""
    scale = 1.0 / float(batch.mask.sum())
    loss_fn = lambda model, mb: masked_token_nll(model, mb, scale)  # noqa: E731
    grads = {}
    for checkpointing in (False, True):
        config = TrainerConfig(activation_checkpointing=checkpointing, lr=1e-2, warmup_steps=2)
        trainer = FSDPTrainer(model_dir, config)
        trainer.accumulate([batch], loss_fn)
        grads[checkpointing] = trainer.full_gradients()
        trainer.optimizer.zero_grad(set_to_none=True)
    steps = [trainer.step([batch], loss_fn) for _ in range(3)]
    return {"grads": grads, "steps": steps}


@pytest.mark.slow
def test_two_gloo_ranks_compute_the_single_process_gradients(
    embedded_model: Path, tmp_path: Path
) -> None:
    batch = fixed_batch(VOCAB, sequences=4, length=48)
    config = TrainerConfig(backend="gloo", cpu_threads=1)

    per_rank = spawn(2, rank_gradients, embedded_model, batch, config, tmp_path)
    ranks = [way for rank in per_rank for way in rank]  # the head in one pass, in chunks
    expected, expected_loss = reference_gradients(embedded_model, batch)

    # Rank 0 gathered the shards and wrote them: the served weights, bit for bit.
    assert {folder for _, _, folder in ranks} == {tmp_path / "weights" / "v0"}
    exported = load_file(tmp_path / "weights" / "v0" / "model.safetensors")
    served = load_file(embedded_model / "model.safetensors")
    assert exported.keys() == served.keys() | {"lm_head.weight"}
    assert all(torch.equal(exported[k], served[k]) for k in served)
    assert torch.equal(exported["lm_head.weight"], served["model.embed_tokens.weight"])
    for grads, loss, _ in ranks:
        assert loss == pytest.approx(expected_loss, rel=1e-5)
        assert grads.keys() == expected.keys()
        worst = max(float((grads[k] - expected[k]).abs().max()) for k in expected)
        scale = max(float(g.abs().max()) for g in expected.values())
        # fp32 sums in another order (per sequence, then across ranks): rounding only.
        assert worst <= 1e-5 * scale, (worst, scale)
    assert all(float(g.abs().sum()) > 0 for g in expected.values())


def test_split_by_tokens_packs_in_order_within_the_budget() -> None:
    items = ["a", "b", "c", "d", "e"]
    assert split_by_tokens(items, [3, 3, 5, 9, 1], max_tokens=6) == [
        ["a", "b"],
        ["c"],
        ["d"],
        ["e"],
    ]
    assert split_by_tokens([], [], max_tokens=4) == []
    with pytest.raises(ValueError, match="lengths"):
        split_by_tokens(items, [1], max_tokens=4)


def test_trainer_config_defaults_pick_the_backend_and_precision_from_the_device() -> None:
    config = TrainerConfig()
    assert (config.backend, config.mixed_precision) == ("auto", "auto")
    with pytest.raises(ValueError):
        TrainerConfig(mixed_precision="fp16")
    assert torch.float32.is_floating_point


@pytest.mark.slow
def test_activation_checkpointing_keeps_the_gradients_and_steps_warm_up(tmp_path: Path) -> None:
    model_dir = save_tiny_llama(tmp_path / "tiny")
    batch = fixed_batch(64, sequences=2, length=16)

    [result] = spawn(1, checkpointing_and_steps, model_dir, batch)

    plain, checkpointed = result["grads"][False], result["grads"][True]
    assert plain.keys() == checkpointed.keys()
    for name, grad in plain.items():
        torch.testing.assert_close(checkpointed[name], grad, rtol=1e-5, atol=1e-7, msg=name)
    steps = result["steps"]
    assert [s.lr for s in steps] == pytest.approx([5e-3, 1e-2, 1e-2])  # linear warmup of 2
    assert [s.step for s in steps] == [1, 2, 3]
    assert steps[2].loss < steps[0].loss  # the same batch three times: it is learned
    assert all(s.grad_norm > 0 and s.micro_batches == 1 for s in steps)


def test_ranks_die_with_the_process_that_spawned_them(tmp_path: Path) -> None:
    """A loop killed with SIGKILL must not leave ranks computing for nobody."""
    pid_file = tmp_path / "rank.pid"
    script = (
        "from pathlib import Path; from libra.trainer import spawn; "
        "from tests.trainer._ranks import write_pid_and_sleep; "
        f"spawn(1, write_pid_and_sleep, Path({str(pid_file)!r}))"
    )
    root = str(Path(__file__).parents[2])
    parent = subprocess.Popen(
        [sys.executable, "-c", script], env={**os.environ, "PYTHONPATH": root}
    )
    try:
        deadline = time.monotonic() + 120
        while not pid_file.exists() or not pid_file.read_text():
            assert parent.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        rank = int(pid_file.read_text())
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 10
    while _alive(rank) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(rank)


def test_a_rank_killed_by_a_fatal_signal_says_where(capfd: pytest.CaptureFixture[str]) -> None:
    from torch.multiprocessing import ProcessExitedException

    with pytest.raises(ProcessExitedException, match="process 1 terminated with signal SIGABRT"):
        spawn(2, abort_on_rank_one)
    # Its stack, written by the rank before it died: the failure names the line.
    assert "in abort_on_rank_one" in capfd.readouterr().err


def test_what_a_rank_built_is_freed_while_its_group_is_alive(tmp_path: Path) -> None:
    assert spawn(2, cycle_left_behind, tmp_path) == [0, 0]
    assert [(tmp_path / f"rank{r}").read_text() for r in (0, 1)] == ["True", "True"]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"  # a zombie has died: only its exit status is left
