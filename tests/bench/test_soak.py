"""``libra bench soak``: trajectories under random faults, each recorded exactly once, with
the fleet's faults recorded as server errors (never as the model's failure)."""

from __future__ import annotations

import argparse
import json

import pytest

from envs_contrib.calc import Calc
from libra.bench._soak import _Tally, main_soak, rss_mb, run_soak
from libra.engine import TrajectoryJob
from libra.envs import Task

pytestmark = pytest.mark.faults

# Every outcome a soak may record: the model's own endings, and server errors (a fault the
# engine could not route around); never an env, sandbox or model failure.
FAULT_FREE = {"completed/model_stop"}
ALLOWED = FAULT_FREE | {"failed/server_error"}


def test_without_faults_every_trajectory_completes() -> None:
    report = run_soak(200, 0.0)
    assert (report.trajectories, report.lost, report.duplicated) == (200, 0, 0)
    assert dict(report.outcomes) == {"completed/model_stop": 200}
    assert report.restarts == 0


def test_faults_and_deaths_lose_nothing_and_are_server_errors() -> None:
    report = run_soak(500, 0.3, seed=1)
    assert (report.trajectories, report.lost, report.duplicated) == (500, 0, 0)
    assert sum(report.outcomes.values()) == 500
    assert set(report.outcomes) <= ALLOWED, report.outcomes
    assert report.outcomes["completed/model_stop"] > 0
    assert report.restarts > 0  # instances died, left the router and came back
    assert report.restarted_serving > 0  # and served again
    assert report.threads_end == report.threads_start
    assert report.leftovers == {"live_ids": 0, "tracks": 0, "homes": 0, "calls_in_flight": 0}


@pytest.mark.faults_long
def test_a_soak_of_ten_thousand_at_five_percent() -> None:
    report = run_soak(10_000, 0.05)
    assert (report.trajectories, report.lost, report.duplicated) == (10_000, 0, 0)
    assert set(report.outcomes) <= ALLOWED, report.outcomes
    assert report.outcomes["completed/model_stop"] > 9_000
    assert report.restarted_serving > 0
    assert report.threads_end == report.threads_start
    assert report.rss_end_mb - report.rss_start_mb < 200  # what is kept is what is in flight


def test_the_tally_counts_a_second_record_and_a_missing_one() -> None:
    tally = _Tally()
    jobs = [TrajectoryJob(Calc, Task.from_seed("calc", seed)) for seed in range(3)]
    for job in jobs:
        tally.submitted(job)
    tally.record(str(jobs[0].id), "completed", "model_stop")
    tally.record(str(jobs[0].id), "failed", "server_error")
    tally.record(str(jobs[1].id), "failed", "server_error")
    assert tally.outstanding == {str(jobs[2].id)}  # lost
    assert tally.duplicated == 1 and tally.recorded == 3
    assert dict(tally.outcomes) == {"completed/model_stop": 1, "failed/server_error": 1}


def test_rss_is_read_now_not_the_peak() -> None:
    before = rss_mb()
    ballast = bytearray(64 * 1024 * 1024)
    ballast[::4096] = b"x" * len(ballast[::4096])  # touch every page
    assert rss_mb() > before + 48
    del ballast
    assert rss_mb() < before + 48


def test_the_command_prints_the_issue_s_shape(capsys: pytest.CaptureFixture[str]) -> None:
    args = argparse.Namespace(n=100, fault_rate=0.05, seed=0, json=True)
    assert main_soak(args) == 0
    printed = json.loads(capsys.readouterr().out)
    for key in ("trajectories", "outcomes", "lost", "duplicated", "rss_start_mb", "rss_end_mb"):
        assert key in printed
    assert printed["trajectories"] == 100 and printed["lost"] == printed["duplicated"] == 0
    assert sum(printed["outcomes"].values()) == 100


def test_a_fault_rate_out_of_range_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    args = argparse.Namespace(n=10, fault_rate=1.5, seed=0, json=True)
    assert main_soak(args) == 2
    assert "fault rate" in capsys.readouterr().err
