"""``libra bench alloc --ahead``: the same work trained however far ahead the rollouts
run, samples no staler than that, a run that repeats for its seed, and the command's
JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from libra.bench._alloc_ahead import run_ahead, summary
from libra.bench._alloc_settings import Settings
from libra.bench._sched_fleet import load_fleet
from libra.cli import main
from libra.emulation.workloads import load_workload


def tiny() -> Settings:
    """swe-drift at two prompts a step (16 trajectories) on 8 workers, 3 steps."""
    workload = load_workload("swe-drift")
    rollout = workload.rollout.model_copy(update={"prompts": 2})
    return Settings(workload.model_copy(update={"rollout": rollout}), load_fleet(), 8, 3)


def test_each_step_trains_its_own_records_at_most_k_versions_behind() -> None:
    runs = [run_ahead(tiny(), ahead) for ahead in (1, 2)]
    one_step_off, two_ahead = runs
    # The same trajectories trained, on the same trainer: only the overlap differs.
    assert one_step_off.tokens == two_ahead.tokens > 0
    assert one_step_off.train_s == pytest.approx(two_ahead.train_s)
    assert one_step_off.sync_s == two_ahead.sync_s > 0
    for run in runs:
        assert len(run.behind) == run.tokens
        # Step 0 samples v0 only; later steps began up to K versions behind their trainer.
        assert min(run.behind) == 0 and max(run.behind) == run.ahead
        assert 0 < run.trainer_idle_frac < 1 and 0 < run.serving_idle_frac < 1
        assert run.seconds > run.train_s + run.sync_s
    assert run_ahead(tiny(), 2) == two_ahead  # virtual time: the same run for its seed
    report = summary(runs)
    ratios = report["vs_one_step_off"]["2"]  # type: ignore[index]
    assert ratios["throughput"] == pytest.approx(one_step_off.seconds / two_ahead.seconds, rel=1e-3)


def test_the_command_prints_one_line_per_k(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    workload = tmp_path / "tiny-drift.toml"
    text = (Path(__file__).parents[2] / "libra/emulation/workloads/swe-drift.toml").read_text()
    workload.write_text(text.replace("prompts = 16", "prompts = 1"))
    argv = ["bench", "alloc", "--workload", str(workload), "--gpus", "8", "--steps", "2"]
    assert main([*argv, "--ahead", "2,1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [row["mode"] for row in report["results"]] == ["one-step-off", "async, max_ahead 2"]
    assert set(report["vs_one_step_off"]) == {"2"}
    assert main([*argv, "--ahead", "0"]) == 2
    assert "--ahead takes steps of 1 or more, not 0" in capsys.readouterr().err
