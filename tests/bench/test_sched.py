"""``libra bench sched``: runs repeat exactly, the lower bound holds, and the command prints
what the issue asks for."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from libra.bench import (
    PolicyRun,
    load_fleet,
    lower_bound,
    parse_policies,
    run_policy,
    run_sched_bench,
    with_mismatch,
)
from libra.cli import main
from libra.emulation.workloads import ScriptBook, load_workload
from libra.sched.policies import ABLATIONS, DEFAULT_POLICIES


def _makespans(runs: list[PolicyRun]) -> dict[str, float]:
    return {run.policy: run.makespan_s for run in runs}


@pytest.mark.slow
def test_the_bench_repeats_exactly_for_a_seed_and_respects_the_bound(tiny: Path) -> None:
    workload, fleet = load_workload(str(tiny)), load_fleet()
    policies = ["round-robin", "cmlfq", "oracle", "oracle-finish"]
    first = run_sched_bench(workload, fleet, policies, seed=3)
    again = run_sched_bench(workload, fleet, policies, seed=3, jobs=2)  # other processes too
    assert first.as_json() == again.as_json()
    assert _makespans(run_sched_bench(workload, fleet, ["cmlfq"], seed=4).runs) != {
        "cmlfq": _makespans(first.runs)["cmlfq"]
    }
    for result in first.results:
        assert result.failed == 0 and result.trajectories == 18
        assert result.vs_bound >= 1.0 and 0.0 <= result.idle_frac < 1.0
    oracle = next(r for r in first.results if r.policy == "oracle")
    assert oracle.vs_oracle == 1.0


def test_the_lower_bound_is_the_larger_of_the_longest_chain_and_the_work(tiny: Path) -> None:
    workload, fleet = load_workload(str(tiny)), load_fleet()
    scripts = ScriptBook(workload).step(1)
    bound = lower_bound(scripts, fleet)
    assert bound.seconds == max(bound.chain_s, bound.work_s) > 0
    longest_tools = max(s.tool_s for s in scripts)
    assert bound.chain_s >= longest_tools
    run = run_policy(workload, fleet, "oracle-finish", seed=0)
    assert run.makespan_s >= bound.seconds
    assert run.output_tokens == sum(s.output_tokens for s in scripts)
    assert set(run.occupancy) == {"short", "medium", "long"}


def test_a_mixed_step_runs_each_env_to_its_end(
    tiny: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    mix = tiny.with_name("mix.toml")
    mix.write_text(
        'name = "mixed"\n[[mix]]\nworkload = "tiny.toml"\nprompts = 2\n'
        '[[mix]]\nworkload = "search-agent"\nprompts = 2\n'
    )
    argv = ["bench", "sched", "--workload", str(mix), "--policies", "cmlfq,oracle"]
    assert main([*argv, "--json", "--jobs", "1", "--trace"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["workload"] == "mixed" and report["trajectories"] == 2 * 3 + 2 * 5
    for result in report["results"]:
        assert result["failed"] == 0 and result["trajectories"] == 16
        assert result["vs_bound"] >= 1.0
    # How far cmlfq's estimates of the remaining output were from the truth, and the tool
    # seconds it did not see coming; the oracle knows both.
    cmlfq, oracle = report["results"]
    assert cmlfq["guess_ratio_median"] > 0 and 0 <= cmlfq["guess_off_2x"] <= 1
    assert cmlfq["tool_s_unseen"] > 0
    assert oracle["guess_ratio_median"] is None
    # --trace: each policy's last trajectory, with the decisions on its calls.
    last = report["stragglers"]["cmlfq"]
    assert last["seconds"] > 0 and last["calls"]
    assert last["seconds"] <= cmlfq["makespan_s"] + 1e-3
    assert last["calls"][0]["true_left"] == last["output_tokens"]  # nothing out yet
    assert all(call["expected"] is not None for call in last["calls"][1:])
    assert {call["expected"] for call in report["stragglers"]["oracle"]["calls"]} != {None}


def test_cmlfq_is_tuned_from_the_command_line_for_a_variant(
    tiny: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["bench", "sched", "--workload", str(tiny), "--policies", "cmlfq", "--json"]
    makespans = []
    for tuned in ([], ["--cmlfq", "tree.quantile=0.97", "--cmlfq", "tie_tolerance=0.05"]):
        assert main([*argv, "--jobs", "1", *tuned]) == 0
        report = json.loads(capsys.readouterr().out)
        makespans.append(report["results"][0]["makespan_s"])
    assert report["cmlfq_settings"] == ["tree.quantile=0.97", "tie_tolerance=0.05"]
    assert makespans[0] != makespans[1]
    assert main([*argv, "--cmlfq", "tree.quantil=0.97"]) == 2
    assert "did you mean tree.quantile?" in capsys.readouterr().err


def test_the_command_prints_the_json_the_issue_asks_for(
    tiny: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["bench", "sched", "--workload", str(tiny), "--policies", "least-loaded,oracle"]
    assert main([*argv, "--json", "--jobs", "1", "--seed", "2"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["workload"] == "data-agent" and report["lower_bound_s"] > 0
    assert report["mismatch"] == "datasheet"  # the default
    assert [r["policy"] for r in report["results"]] == ["least-loaded", "oracle"]
    keys = {"policy", "throughput_traj_s", "throughput_tok_s", "makespan_s", "idle_frac"}
    for result in report["results"]:
        assert keys | {"vs_oracle", "vs_bound", "vs_cmlfq", "preemptions"} <= set(result)


@pytest.mark.slow
def test_the_command_prints_a_table_and_draws_the_plot(
    tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    picture = tmp_path / "sched.png"
    argv = ["bench", "sched", "--workload", str(tiny), "--policies", "cmlfq,sorted"]
    assert main([*argv, "--jobs", "1", "--plot", str(picture)]) == 0
    out = capsys.readouterr().out
    for text in ("cmlfq", "sorted", "makespan s", "x bound", "lower bound"):
        assert text in out
    assert picture.read_bytes().startswith(b"\x89PNG")


def test_ablate_adds_cmlfq_without_each_mechanism_in_the_registry_s_order() -> None:
    assert parse_policies("cmlfq,least-loaded") == ["cmlfq", "least-loaded"]
    assert parse_policies("cmlfq,least-loaded", ablate=True) == [
        "least-loaded",
        "cmlfq",
        "cmlfq-no-signal",
        "cmlfq-no-priority",
        "cmlfq-no-quantum",
        "cmlfq-history",
    ]
    assert set(parse_policies("", ablate=True)) == set(DEFAULT_POLICIES) | set(ABLATIONS)


def test_bad_arguments_are_one_line_errors(tiny: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "sched", "--workload", "nope", "--jobs", "1"]) == 2
    assert "unknown name 'nope'" in capsys.readouterr().err
    assert main(["bench", "sched", "--workload", str(tiny), "--policies", "fifo"]) == 2
    assert "unknown policies fifo" in capsys.readouterr().err


def test_the_fit_moves_each_instance_s_cost_towards_what_its_server_plays(tiny: Path) -> None:
    workload, fleet = load_workload(str(tiny)), with_mismatch(load_fleet(), "slow-tp")
    run = run_policy(workload, fleet, "cmlfq-fit", seed=0)
    assert run.failed == 0 and run.fitted
    plans = {plan.name: plan for plan in fleet.instances}
    moved = 0
    for name, fitted in run.fitted.items():
        tp = plans[name].tp
        prior, truth = fleet.step_cost(tp), fleet.latency(tp)
        if fitted == prior:
            continue  # never observed: still the prior
        moved += 1
        if tp == 4:  # the prior is furthest off where all-reduces weigh most
            batch, context = 8, 8 * 6_000
            fitted_s = fitted.step_time(batch, context)
            truth_s, prior_s = truth.step_time(batch, context), prior.step_time(batch, context)
            assert abs(fitted_s - truth_s) < abs(prior_s - truth_s)
    assert moved > 0


@pytest.mark.slow
def test_the_calibrated_run_keeps_the_figures_of_the_readme() -> None:
    workload, fleet = load_workload("swe-agent"), with_mismatch(load_fleet(), "none")
    policies = ["round-robin", "least-loaded", "sorted", "cmlfq"]
    report = run_sched_bench(workload, fleet, policies, seed=0, jobs=2, mismatch="none")
    makespans = {r.policy: round(r.makespan_s, 1) for r in report.results}
    assert makespans == {
        "round-robin": 771.0,
        "least-loaded": 490.0,
        "sorted": 420.0,
        "cmlfq": 399.5,
    }
    assert round(report.lower_bound.seconds, 1) == 266.3


def test_the_help_lists_the_mismatch_presets(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "sched", "--help"])
    assert exit_.value.code == 0
    out = " ".join(capsys.readouterr().out.split()).replace("- ", "-")  # unwrapped
    for preset in ("none", "datasheet", "slow-tp", "low-bandwidth", "small-kv"):
        assert preset in out
