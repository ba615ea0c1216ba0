"""The loop of ``libra train``: rollout session, GRPO step in the trainer's processes,
weights exported and versions bumped, one metrics line a step.

The fast tests run on the in-process emulator with a tiny random Llama (its vocabulary
covers the emulator's byte tokens). The emulator holds no weights: its endpoints' versions
are bumped without a reload (``reload_weights`` is False there by default), and its
logprobs are made up, so the gap it reports is large and only checked to be measured.
The real reload, and a gap that means something, are the slow test's, on the embedded
model with vLLM.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
import torch

from libra.config import ConfigError, UsageError, load_config
from libra.launch import (
    EnvShare,
    RolloutConfig,
    TrainRunConfig,
    load_mixture,
    read_tasks,
    train,
)
from libra.train import StepTasks, TaskShare, iter_metrics, read_step, step_file
from libra.trainer import (
    Batch,
    FSDPTrainer,
    GRPOConfig,
    StepMetrics,
    Train,
    TrainConfig,
    TrainerConfig,
    build_batch,
    combine_loss_metrics,
    find_latest,
    spawn,
)
from tests._helpers import BREVITY, QUIZ, children_of, cmdline_of, is_alive
from tests.trainer._ranks import samples as two_groups

pytestmark = pytest.mark.anyio


def run_config(run_dir: Path, model_dir: Path, **overrides: Any) -> TrainRunConfig:
    data: dict[str, Any] = {
        "rollout": {
            "env": BREVITY,
            # Per-request seeds (from each trajectory's id) and filler of random length
            # before each answer: the samples of a group differ, and so do their rewards.
            "engine": {"concurrency": 8, "sampling": {"max_tokens_per_turn": 48, "seed": 0}},
            "emulator": {"agent": {"think_tokens": [0, 40]}},
        },
        "model": str(model_dir),
        "steps": 2,
        "prompts_per_step": 2,
        "samples_per_prompt": 3,
        "run_dir": str(run_dir),
        "trainer": {"lr": 1e-3, "cpu_threads": 1, "backend": "gloo"},
    }
    data.update(overrides)
    return TrainRunConfig.model_validate(data)


def read_records(run_dir: Path, step: int) -> list[dict[str, Any]]:
    lines = (run_dir / "rollouts" / f"step-{step}.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


# The whole loop once on trio too: the run's own code is backend-neutral (anyio).
@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_two_sync_steps_train_export_and_bump_versions(
    tiny_model: Path, tmp_path: Path
) -> None:
    config = run_config(tmp_path / "run", tiny_model)
    seen: list[int] = []
    lines = await train(config, on_step=lambda record: seen.append(record.step))

    assert seen == [0, 1]
    assert [line.version for line in lines] == [0, 1]
    assert [line.weight_version for line in lines] == [1, 2]
    for line in lines:
        assert line.trajectories == 6 and line.groups == 2
        assert line.groups_used == 2 and line.samples_trained == 6  # rewards never tie
        assert line.tokens_trained > 0 and line.dropped == {}
        assert line.loss["tokens"] == line.tokens_trained
        assert line.grad_norm is not None and line.grad_norm > 0
        assert line.logprob_gap_tokens > 0 and math.isfinite(line.logprob_gap_mean)
        assert line.rollout_s > 0 and line.train_s > 0 and line.export_s > 0
        assert line.sync_s == 0.0  # no reload on the emulator
    # Sync mode: every record of step k was sampled on version k, and says so.
    for step in (0, 1):
        records = read_records(config.run_dir, step)
        assert len(records) == 6
        assert {r["step"] for r in records} == {step}
        assert {r["weight_version"] for r in records} == {step}
        assert {span[2] for r in records for span in r["weight_versions"]} == {
            step
        }  # [start, end, version]
    written = list(iter_metrics(config.run_dir))
    assert [w["step"] for w in written] == [0, 1] and written[1]["weight_version"] == 2
    # Weights kept: the served version and the one before it (the emulator starts from
    # no folder of the run's: there is no v0 here).
    weights = sorted(p.name for p in (config.run_dir / "weights").iterdir())
    assert weights == ["v1", "v2"]
    assert (config.run_dir / "weights" / "v2" / "model.safetensors").is_file()


async def test_one_step_off_samples_the_next_step_on_the_old_weights(
    tiny_model: Path, tmp_path: Path
) -> None:
    config = run_config(
        tmp_path / "run",
        tiny_model,
        steps=3,
        mode="one-step-off",
        grpo={"max_staleness": 0},
    )
    lines = await train(config)

    # Step 0 samples v0 and trains it; steps 1 and 2 were submitted before the previous
    # step's sync, so their trajectories start one version behind the trainer.
    first = {r["weight_version"] for r in read_records(config.run_dir, 0)}
    later = [{r["weight_version"] for r in read_records(config.run_dir, s)} for s in (1, 2)]
    assert first == {0}
    assert later[0] <= {0, 1} and later[1] <= {1, 2}
    assert lines[0].samples_trained == 6
    # A bound of 0 drops what started on older weights, counted under its reason.
    for line, versions in zip(lines[1:], later, strict=True):
        stale = sum(1 for r in versions if r < line.version)
        assert stale == 0 or line.dropped.get("stale", 0) > 0
    assert [line.weight_version for line in lines] == [1, 2, 3]
    weights = sorted(p.name for p in (config.run_dir / "weights").iterdir())
    assert weights == ["v2", "v3"]


@pytest.mark.parametrize("bound", [1, 2])
async def test_async_runs_the_rollouts_of_steps_ahead_while_a_step_trains(
    tiny_model: Path, tmp_path: Path, bound: int
) -> None:
    config = run_config(
        tmp_path / "run",
        tiny_model,
        steps=4,
        mode="async",
        max_ahead=2,
        grpo={"max_staleness": bound},
    )
    lines = await train(config)

    versions = [[r["weight_version"] for r in read_records(config.run_dir, s)] for s in range(4)]
    # Steps 0 and 1 were submitted at the start, step 2 when step 0's groups were in,
    # before it trained: they all began on v0. Step k + 2's rollouts run while step k
    # trains, so no record of step k began on weights older than v(k - 2).
    assert set(versions[0]) == set(versions[1]) == {0}
    assert min(versions[2]) == 0
    for step, began in enumerate(versions):
        assert min(began) >= step - 2
    # The batch builder keeps no sample more than the bound behind: a bound of 1 drops
    # step 2's samples that began on v0 (counted), a bound of 2 keeps them.
    for line, began in zip(lines, versions, strict=True):
        behind = sum(1 for version in began if line.version - version > bound)
        assert line.dropped.get("stale", 0) == behind, (line, began)
    assert lines[2].dropped.get("stale", 0) > 0 if bound == 1 else "stale" not in lines[2].dropped
    assert [line.weight_version for line in lines] == [1, 2, 3, 4]


def mixture_config(
    run_dir: Path, model_dir: Path, folder: Path, **overrides: Any
) -> TrainRunConfig:
    """Brevity's seeded tasks twice as often as Quiz's, from a file of three questions."""
    quiz = folder / "quiz.jsonl"
    lines = [{"key": f"q{i}", "payload": {"question": f"what is {i} + {i}?"}} for i in range(3)]
    quiz.write_text("".join(json.dumps(line) + "\n" for line in lines))
    data = run_config(run_dir, model_dir, **overrides).model_dump(mode="json", exclude_unset=True)
    del data["rollout"]["env"]
    data["rollout"]["envs"] = [{"env": BREVITY, "weight": 2}, {"env": QUIZ, "tasks": str(quiz)}]
    return TrainRunConfig.model_validate(data)


async def test_a_mixture_of_envs_trains_with_each_env_s_figures(
    tiny_model: Path, tmp_path: Path
) -> None:
    config = mixture_config(tmp_path / "run", tiny_model, tmp_path, steps=3)
    lines = await train(config)
    shares = [
        TaskShare("brevity", 2),
        TaskShare("quiz", 1, read_tasks(tmp_path / "quiz.jsonl", "quiz")),
    ]
    drawn = StepTasks(shares, config.prompts_per_step, config.seed)
    for line in lines:
        played = {r["task_id"] for r in read_records(config.run_dir, line.step)}
        assert played == {str(task.id) for task in drawn.of_step(line.step)}
        assert line.envs is not None and set(line.envs) == {t.split("/")[0] for t in played}
        figures: list[dict[str, Any]] = list(line.envs.values())
        assert sum(env["trajectories"] for env in figures) == line.trajectories
        assert all(env["reward_mean"] is not None for env in figures)
        assert all(env["response_tokens_mean"] > 0 for env in figures)
    assert "envs" in json.loads((config.run_dir / "metrics.jsonl").read_text().splitlines()[0])


async def test_a_task_file_too_short_for_a_step_is_refused_before_anything_starts(
    tmp_path: Path,
) -> None:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"key": f"q{i}"}) + "\n" for i in range(3)))
    short = run_config(tmp_path / "short", tmp_path / "model", prompts_per_step=4)
    short.rollout.tasks = tasks
    with pytest.raises(ConfigError, match="lists 3 tasks, fewer than the 4 a step plays"):
        await train(short)
    assert not short.run_dir.exists()


def test_a_mixture_is_named_one_way() -> None:
    with pytest.raises(ValueError, match=r"drop rollout\.env"):
        RolloutConfig(env=BREVITY, envs=[EnvShare(env=QUIZ)])
    twice = RolloutConfig(envs=[EnvShare(env=QUIZ), EnvShare(env="tests._helpers:Quiz")])
    with pytest.raises(UsageError, match="two envs go by one name"):
        load_mixture(twice)


async def test_a_run_folder_is_never_reused(tiny_model: Path, tmp_path: Path) -> None:
    config = run_config(tmp_path / "run", tiny_model, steps=1)
    config.run_dir.mkdir()
    (config.run_dir / "metrics.jsonl").write_text("{}\n")  # as a run leaves it
    with pytest.raises(FileExistsError):
        await train(config)
    assert not (config.run_dir / "rollouts").exists()  # refused before anything started


def test_the_resolved_config_loads_back_the_same(tmp_path: Path) -> None:
    config = run_config(tmp_path / "run", tmp_path / "model", mode="one-step-off")
    file = tmp_path / "config.toml"
    file.write_text(config.to_toml())
    assert load_config(TrainRunConfig, file) == config


def test_the_loop_owns_the_rollout_size_and_refuses_a_reference_kl(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"rollout\.n"):
        run_config(tmp_path, tmp_path, rollout={"env": BREVITY, "n": 8})
    with pytest.raises(ValueError, match="reference model"):
        run_config(tmp_path, tmp_path, grpo={"kl_coef": 0.1})


# ------------------------------------------------------------------- loss scaling


def train_once(model_dir: Path, batch: Batch, grpo: GRPOConfig) -> tuple[StepMetrics, float]:
    """One step on a fresh trainer (each rank): its metrics and the summed policy loss."""
    trainer = FSDPTrainer(model_dir, TrainerConfig(backend="gloo", cpu_threads=1, grad_clip=None))
    result = Train(batch, grpo, temperature=1.0).run(trainer)
    return result.step, result.loss["policy_loss"]


def reference_gradient_norm(model_dir: Path, batch: Batch, grpo: GRPOConfig) -> float:
    """The batch's loss computed at once on a plain model (one micro-batch), backward."""
    from transformers import AutoModelForCausalLM

    from libra.trainer import token_logprobs

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    [micro] = batch.micro_batches
    logits = model(
        input_ids=micro.input_ids, position_ids=micro.position_ids, use_cache=False
    ).logits
    loss, _ = micro.loss(token_logprobs(logits, micro.targets), grpo)
    loss.backward()
    squares = sum(float(p.grad.pow(2).sum()) for p in model.parameters() if p.grad is not None)
    return math.sqrt(squares)


@pytest.mark.parametrize("ranks", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_micro_batches_and_ranks_give_the_whole_batch_gradient(
    tiny_model: Path, ranks: int
) -> None:
    """The trainer averages over micro-batches and ranks; the loop's loss undoes it."""
    grpo = GRPOConfig()
    samples = two_groups(0)
    whole = build_batch(samples, current_version=0, grpo=grpo, train=TrainConfig())
    split = build_batch(
        samples, current_version=0, grpo=grpo, train=TrainConfig(micro_batch_tokens=40), ranks=ranks
    )
    assert len(whole.micro_batches) == 1 and len(split.micro_batches) >= 2 * ranks
    expected = reference_gradient_norm(tiny_model, whole, grpo)
    [(one, one_loss)] = spawn(1, train_once, tiny_model, whole, grpo)
    (many, many_loss), *_ = spawn(ranks, train_once, tiny_model, split, grpo)
    assert one.grad_norm == pytest.approx(expected, rel=1e-4)
    assert many.grad_norm == pytest.approx(expected, rel=1e-4)
    assert many.loss == pytest.approx(one.loss, rel=1e-5, abs=1e-7)
    assert many_loss == pytest.approx(one_loss, rel=1e-5, abs=1e-7)


def test_loss_metrics_combine_as_the_whole_batch() -> None:
    parts = [
        {"policy_loss": 0.5, "tokens": 2.0, "ratio_max": 1.1, "approx_kl": 0.1, "gap_mean": 0.0},
        {"policy_loss": -0.25, "tokens": 6.0, "ratio_max": 1.0, "approx_kl": 0.3, "gap_mean": 0.2},
        {"policy_loss": 0.0, "tokens": 0.0, "ratio_max": 0.0, "approx_kl": 0.0, "gap_mean": 0.0},
    ]
    # The gap's mean is over the tokens the trained weights sampled: 1 + 3 of them here.
    for part, current, lowest in zip(parts, (1.0, 3.0, 0.0), (0.9, 0.8, 0.0), strict=True):
        part |= {"gap_tokens": current, "gap_max": part["gap_mean"], "ratio_min": lowest}
    combined = combine_loss_metrics(parts)
    assert combined == pytest.approx(
        {
            "policy_loss": 0.25,
            "tokens": 8.0,
            "ratio_min": 0.8,
            "ratio_max": 1.1,
            "approx_kl": 0.25,
            "gap_mean": 0.15,
            "gap_tokens": 4.0,
            "gap_max": 0.2,
        }
    )


def _train_process(config_file: Path, log: Path, *extra: str) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "libra", "train", "--config", str(config_file)]
    with log.open("wb") as err:
        return subprocess.Popen(
            [*command, "--no-progress", *extra],
            env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])},
            stdout=subprocess.DEVNULL,
            stderr=err,
        )


def _task_keys(run_dir: Path, step: int) -> list[tuple[str, int]]:
    return sorted((r["task_id"], r["sample"]) for r in read_records(run_dir, step))


async def test_a_killed_run_resumes_from_its_checkpoint_to_the_same_tasks(
    tiny_model: Path, tmp_path: Path
) -> None:
    config = mixture_config(tmp_path / "killed", tiny_model, tmp_path, steps=3)
    config_file = tmp_path / "train.toml"
    config_file.write_text(config.to_toml())
    log = tmp_path / "train.log"
    killed = _train_process(config_file, log)
    metrics = config.run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        assert killed.poll() is None, log.read_text()
        assert time.monotonic() < deadline
        await anyio.sleep(0.1)
    killed.send_signal(signal.SIGKILL)  # after step 1's line: maybe before its checkpoint
    killed.wait()
    step_0 = (config.run_dir / "rollouts" / "step-0.jsonl").stat().st_mtime_ns
    resumed = _train_process(config_file, log, "--resume")
    returncode = await anyio.to_thread.run_sync(lambda: resumed.wait(timeout=300))
    assert returncode == 0, log.read_text()

    lines = list(iter_metrics(config.run_dir))
    assert [line["step"] for line in lines] == [0, 1, 2]
    assert [line["weight_version"] for line in lines] == [1, 2, 3]
    # The resumed run started from a checkpoint, not from step 0.
    assert (config.run_dir / "rollouts" / "step-0.jsonl").stat().st_mtime_ns == step_0
    whole = mixture_config(tmp_path / "whole", tiny_model, tmp_path, steps=3)
    await train(whole)
    for step in range(3):
        assert _task_keys(config.run_dir, step) == _task_keys(whole.run_dir, step)


async def test_a_run_killed_between_an_export_and_its_checkpoint_resumes(
    tiny_model: Path, tmp_path: Path
) -> None:
    """Step 1 exported v2, then the run died before step 1's checkpoint: the resumed run
    redoes step 1 from the step-1 checkpoint and exports v2 again."""
    config = run_config(tmp_path / "run", tiny_model)
    await train(config)
    shutil.rmtree(config.run_dir / "checkpoints" / "step-00000002")  # never written
    assert (config.run_dir / "weights" / "v2").is_dir()  # but the export was
    lines = await train(config, resume=True)
    assert [line.step for line in lines] == [1]
    assert [line["weight_version"] for line in iter_metrics(config.run_dir)] == [1, 2]


def test_resume_without_a_checkpoint_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from libra.cli import main

    args = ["train", "--resume", "--run-dir", str(tmp_path), "--set", f"rollout.env={BREVITY}"]
    assert main(args) == 1
    assert (
        capsys.readouterr().err.strip()
        == f"libra: error: {tmp_path} holds no checkpoint to resume from"
    )


async def test_a_resumed_run_goes_on_with_the_cmlfq_forest_it_saved(
    tiny_model: Path, tmp_path: Path
) -> None:
    first = run_config(tmp_path / "run", tiny_model, steps=2)
    rollout = first.rollout.model_copy(update={"scheduler": "cmlfq"})
    first = first.model_copy(update={"rollout": rollout})
    await train(first)
    saved = find_latest(first.run_dir)
    assert saved is not None and saved.run.step == 2 and saved.forest_path is not None

    lines = await train(first.model_copy(update={"steps": 3}), resume=True)
    assert [line.step for line in lines] == [2]
    assert [line["step"] for line in iter_metrics(first.run_dir)] == [0, 1, 2]
    latest = find_latest(first.run_dir)
    assert latest is not None and latest.run.weight_version == 3


# ------------------------------------------------------------ faults mid-step


def _slow_rollout_config(run_dir: Path, model_dir: Path, **overrides: Any) -> TrainRunConfig:
    """Trajectories that take a second or so each, two at a time: a step's rollout lasts
    long enough for a test to stop the run after some of its records and before all."""
    rollout = {
        "env": BREVITY,
        "engine": {"concurrency": 2, "sampling": {"max_tokens_per_turn": 48, "seed": 0}},
        "emulator": {"agent": {"think_tokens": [0, 40]}, "latency": {"step_base_s": 0.05}},
    }
    return run_config(run_dir, model_dir, rollout=rollout, **overrides)


async def _wait_for_step_1_records(
    run_dir: Path, process: subprocess.Popen[bytes], log: Path, count: int
) -> None:
    """Until step 0's checkpoint is written and ``count`` of step 1's records are (step 1
    is submitted before step 0's checkpoint: its records may come first)."""
    deadline = time.monotonic() + 300
    while not (find_latest(run_dir) is not None and len(read_step(run_dir, 1)) >= count):
        assert process.poll() is None, _text(log)
        assert time.monotonic() < deadline
        await anyio.sleep(0.05)


def _text(log: Path) -> str:
    return log.read_text()


def _assert_one_record_per_trajectory(run_dir: Path, steps: int) -> None:
    for step in range(steps):
        records = read_step(run_dir, step)
        assert len(records) == 6 and len({r.id for r in records}) == 6
        by_group = sorted(
            sorted(r.sample for r in records if r.group_id == g)
            for g in {r.group_id for r in records}
        )
        assert by_group == [[0, 1, 2], [0, 1, 2]]


@pytest.mark.faults
async def test_a_run_killed_mid_step_takes_its_finished_records_back_from_the_log(
    tiny_model: Path, tmp_path: Path
) -> None:
    config = _slow_rollout_config(tmp_path / "run", tiny_model)
    config_file = tmp_path / "train.toml"
    config_file.write_text(config.to_toml())
    log = tmp_path / "train.log"
    killed = _train_process(config_file, log)
    await _wait_for_step_1_records(config.run_dir, killed, log, count=2)
    killed.send_signal(signal.SIGKILL)  # step 1's rollout is under way
    killed.wait()
    logged = read_step(config.run_dir, 1)
    assert 2 <= len(logged) < 6, "the kill was meant to come mid-rollout"
    with step_file(config.run_dir, 1).open("ab") as out:
        out.write(b'{"id": "torn by the kill')  # as a kill mid-write leaves it

    resumed = _train_process(config_file, log, "--resume")
    returncode = await anyio.to_thread.run_sync(lambda: resumed.wait(timeout=300))
    assert returncode == 0, log.read_text()

    lines = list(iter_metrics(config.run_dir))
    assert [line["step"] for line in lines] == [0, 1]
    assert [line["reused"] for line in lines] == [0, len(logged)]
    assert [line["trajectories"] for line in lines] == [6, 6]
    _assert_one_record_per_trajectory(config.run_dir, 2)
    # The logged records are the step's, as they were: read back, not sampled again.
    assert read_step(config.run_dir, 1)[: len(logged)] == logged


def _trainer_ranks(train_pid: int) -> list[int]:
    """The ranks of a ``libra train`` process: the children of its trainer's process."""
    trainers = [pid for pid in children_of(train_pid) if "spawn_main" in cmdline_of(pid)]
    return [rank for trainer in trainers for rank in children_of(trainer)]


@pytest.mark.faults
@pytest.mark.slow
async def test_a_trainer_rank_killed_mid_step_stops_the_run_and_resume_finishes_it(
    tiny_model: Path, tmp_path: Path
) -> None:
    config = _slow_rollout_config(tmp_path / "run", tiny_model, steps=3, world_size=2)
    config_file = tmp_path / "train.toml"
    config_file.write_text(config.to_toml())
    log = tmp_path / "train.log"
    stopped = _train_process(config_file, log)
    await _wait_for_step_1_records(config.run_dir, stopped, log, count=1)
    ranks = _trainer_ranks(stopped.pid)
    assert len(ranks) == 2
    killed_at = time.monotonic()
    os.kill(max(ranks), signal.SIGKILL)
    returncode = await anyio.to_thread.run_sync(lambda: stopped.wait(timeout=120))
    stopped_s = time.monotonic() - killed_at

    errors = log.read_text()
    assert returncode == 1, errors
    assert re.search(r"^libra: error: trainer rank [01] died \(SIGKILL\)$", errors, re.M), errors
    assert "`libra train --resume`" in errors and "step 1 (its checkpoint)" in errors
    assert stopped_s < 60  # noticed while the loop waited for rollouts, not at the next call
    assert not any(is_alive(rank) for rank in ranks)  # the trainer's processes are gone
    latest = find_latest(config.run_dir)
    assert latest is not None and latest.run.step == 1
    logged = read_step(config.run_dir, 1)

    resumed = _train_process(config_file, log, "--resume")
    returncode = await anyio.to_thread.run_sync(lambda: resumed.wait(timeout=300))
    assert returncode == 0, log.read_text()
    lines = list(iter_metrics(config.run_dir))
    assert [line["step"] for line in lines] == [0, 1, 2]
    assert [line["weight_version"] for line in lines] == [1, 2, 3]
    assert lines[1]["reused"] == len(logged) >= 1
    _assert_one_record_per_trajectory(config.run_dir, 3)


def _failing_config(run_dir: Path, model_dir: Path, failures: str) -> TrainRunConfig:
    """Half the generation requests fail, and the engine tries each once: about half the
    trajectories fail as server errors (one at a time, so the same ones every run)."""
    rollout = {
        "env": BREVITY,
        "engine": {
            "concurrency": 1,
            "max_attempts": 1,
            "sampling": {"max_tokens_per_turn": 48, "seed": 0},
        },
        "emulator": {"agent": {"think_tokens": [0, 40]}, "error_rate": 0.5},
    }
    train = {"failures": failures, "max_retries": 8}
    return run_config(run_dir, model_dir, rollout=rollout, steps=1, train=train)


async def test_infrastructure_failures_are_excluded_or_retried_as_configured(
    tiny_model: Path, tmp_path: Path
) -> None:
    [excluded] = await train(_failing_config(tmp_path / "exclude", tiny_model, "exclude"))
    failed = [r for r in read_step(tmp_path / "exclude", 0) if r.status == "failed"]
    assert failed and {r.stop_reason for r in failed} == {"server_error"}
    assert excluded.retried == 0 and excluded.statuses["failed"] == len(failed)
    assert excluded.trajectories == 6 and excluded.samples_trained <= 6 - len(failed)

    [retried] = await train(_failing_config(tmp_path / "retry", tiny_model, "retry"))
    records = read_step(tmp_path / "retry", 0)
    # Each trajectory has one record, of its last run: none failed 9 times in a row here.
    assert len(records) == 6 and len({r.id for r in records}) == 6
    assert {r.status for r in records} <= {"completed", "truncated"}
    assert retried.retried >= len(failed) and "failed" not in retried.statuses
    assert retried.trajectories == 6 and retried.samples_trained == 6


@pytest.mark.parametrize("ahead", [{"mode": "one-step-off"}, {"mode": "async", "max_ahead": 2}])
async def test_a_resume_ahead_takes_back_what_the_checkpoint_weights_sampled(
    tiny_model: Path, tmp_path: Path, ahead: dict[str, Any]
) -> None:
    """Checkpoints after steps 2 and 3 lost: the resume from step 1 (weights v1) takes back
    step 1's records (sampled on v0 and v1) and those of step 2 that v1 or older sampled
    alone (step 2 sampled while step 1 trained, or step 0 with ``max_ahead = 2``); one
    that v2 touched (lost with the killed run's steps) runs again."""
    config = run_config(tmp_path / "run", tiny_model, steps=3, **ahead)
    await train(config)
    for step in (2, 3):
        shutil.rmtree(config.run_dir / "checkpoints" / f"step-{step:08d}")
    # On the emulator step 2's rollouts end before step 1's sync: as if one ran past it,
    # its last span is v2's.
    step_2 = read_step(config.run_dir, 2)
    step_2[0].weight_versions[-1].version = 2
    lines_2 = [msgspec.json.encode(record) + b"\n" for record in step_2]
    step_file(config.run_dir, 2).write_bytes(b"".join(lines_2))
    newest = {
        step: [max(s.version for s in r.weight_versions) for r in read_step(config.run_dir, step)]
        for step in (1, 2)
    }
    lines = await train(config, resume=True)

    assert [line.step for line in lines] == [1, 2]
    assert lines[0].reused == 6 and max(newest[1]) <= 1
    assert lines[1].reused == sum(1 for version in newest[2] if version <= 1) == 5
    assert step_2[0].id in {r.id for r in read_step(config.run_dir, 2)[5:]}  # sampled again
    assert [line["step"] for line in iter_metrics(config.run_dir)] == [0, 1, 2]
    _assert_one_record_per_trajectory(config.run_dir, 3)
