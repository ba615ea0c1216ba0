"""``libra bench alloc``: a tiny multi-step run repeats for a seed, every configuration
gives sane numbers, the planner learns, and the command prints the JSON the issue asks."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from libra.alloc import TailRule, TrainCost
from libra.bench._alloc import ConfigRun, StepResult, config_names, run_alloc_bench, run_config
from libra.bench._alloc_demand import demand_of_scripts
from libra.bench._alloc_report import _swing, summary
from libra.bench._alloc_settings import Settings
from libra.bench._alloc_strategies import every_layout, layout_name, parse_layout
from libra.bench._sched_fleet import load_fleet
from libra.cli import main
from libra.emulation.workloads import ScriptTurn, TrajectoryScript, Workload, load_workload


def tiny_workload() -> Workload:
    """swe-drift at two prompts a step: 16 trajectories."""
    workload = load_workload("swe-drift")
    rollout = workload.rollout.model_copy(update={"prompts": 2})
    return workload.model_copy(update={"rollout": rollout})


def tiny(seed: int = 0) -> Settings:
    return Settings(tiny_workload(), load_fleet(), gpus=8, steps=2, seed=seed)


def test_the_configurations_are_the_issues() -> None:
    names = config_names(tiny())
    # 8 A100s: two training workers cannot hold a 14B model's state, so no 1:3 split.
    assert names == [
        "static-2:2",
        "static-3:1",
        "colocated",
        "planner",
        "planner-prior+30%",
        "planner-prior-30%",
        "libra-no-pool",
        "libra",
    ]


def _sane(run: ConfigRun) -> None:
    assert len(run.steps) == 2
    for step in run.steps:
        assert step.rollout_s > 0 and step.train_s > 0 and step.overhead_s > 0
        assert step.train_tokens > 0
        assert step.train_workers + (0 if step.colocated else sum(step.rollout_tps)) == 8
    assert run.throughput_tok_s > 0 and 0.0 <= run.idle_frac < 1.0


@pytest.mark.slow
def test_a_run_repeats_for_its_seed_and_every_config_is_sane() -> None:
    names = ["static-2:2", "colocated", "planner"]
    first = run_alloc_bench(tiny(), names)
    again = run_alloc_bench(tiny(), names, jobs=2)  # in other processes too
    assert summary(first) == summary(again)
    steps = summary(first)["steps"]
    for run in first:
        _sane(run)
        assert [s["rollout_s"] for s in steps[run.config]] == [
            round(step.rollout_s, 1) for step in run.steps
        ]
    static, colocated, planner = first
    assert all(step.colocated for step in colocated.steps)
    assert not any(step.colocated for step in static.steps)
    assert colocated.steps[0].step_s == pytest.approx(
        sum(getattr(colocated.steps[0], part) for part in ("rollout_s", "train_s", "overhead_s"))
    )
    assert len(planner.plan_errors) == 2  # one prediction per step, set beside its measure
    other = run_config(tiny(seed=5), "static-2:2")
    assert other.step_time_s != static.step_time_s


@pytest.mark.slow
def test_a_mis_specified_prior_converges_to_the_fitted_costs() -> None:
    """Priors 30% off either way predict far apart at first; after a few steps' fits
    their predictions agree (they are fitted to the same observations)."""
    settings = Settings(tiny_workload(), load_fleet(), gpus=8, steps=3)
    names = ("planner", "planner-prior+30%", "planner-prior-30%")
    errors = [run_config(settings, name).plan_errors for name in names]
    first = [run[0] for run in errors]
    last = [run[-1] for run in errors]
    assert max(first) - min(first) > 0.2
    assert max(last) - min(last) < 0.5 * (max(first) - min(first))


@pytest.mark.slow
def test_the_command_prints_the_json_and_draws_the_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    workload = tmp_path / "tiny-drift.toml"
    text = (Path(__file__).parents[2] / "libra/emulation/workloads/swe-drift.toml").read_text()
    workload.write_text(text.replace("prompts = 16", "prompts = 2"))
    figure = tmp_path / "alloc.png"
    argv = ["bench", "alloc", "--workload", str(workload), "--gpus", "8", "--steps", "2"]
    assert main([*argv, "--json", "--jobs", "1", "--plot", str(figure)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [row["config"] for row in report["results"]] == config_names(tiny())
    for row in report["results"]:
        assert set(row) == {"config", "step_time_s", "throughput_tok_s", "idle_frac"}
        assert row["step_time_s"] > 0 and row["throughput_tok_s"] > 0
    assert set(report["libra_vs"]) == {
        "static_upfront",
        "static_best_hindsight",
        "colocated",
        "libra_no_pool",
    }
    assert all(value > 0 for value in report["libra_vs"].values())
    # No packing of libra's work beats that work with no worker idle.
    assert report["libra_no_idle_vs_static_upfront"] >= report["libra_vs"]["static_upfront"]
    # No configuration beats what no split and no routing can.
    upfront = next(row for row in report["results"] if row["config"] == "static-2:2")
    best = max(row["throughput_tok_s"] for row in report["results"])
    assert report["bound_vs_static_upfront"] > best / upfront["throughput_tok_s"]
    assert report["plan_error_max"] >= 0 and report["model_error_max"] >= 0
    assert all(0 <= idle < 1 for idle in report["rollout_idle_frac"].values())
    assert figure.stat().st_size > 10_000


@pytest.mark.slow
def test_too_few_workers_for_the_training_state_is_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    workload = tmp_path / "tiny-drift.toml"
    text = (Path(__file__).parents[2] / "libra/emulation/workloads/swe-drift.toml").read_text()
    workload.write_text(text.replace("prompts = 16", "prompts = 1"))
    argv = ["bench", "alloc", "--workload", str(workload), "--gpus", "4", "--steps", "1"]
    assert main([*argv, "--jobs", "1"]) == 2
    assert "no plan of 4 workers fits" in capsys.readouterr().err


def eager_pool() -> Settings:
    """12 workers (4 train, two TP4 instances) and a tail rule that lends one instance as
    soon as the rollout starts, its restart priced free: the pool's moves on a run that
    takes seconds."""
    rule = TailRule(trajectories_per_instance=16, min_train_left_s=0, restart_s=0)
    return Settings(tiny_workload(), load_fleet(), gpus=12, steps=2, tail=rule)


def test_full_libra_moves_a_unit_into_training_and_back_inside_the_steps() -> None:
    run = run_config(eager_pool(), "libra")
    lent, back = run.steps
    assert lent.borrows == 1 and lent.releases == 0
    assert lent.mean_train_workers > lent.train_workers  # the borrowed unit trained
    assert [unit for unit, _ in lent.lent] == [(8, 9, 10, 11)]
    assert back.releases == 1  # the next rollout took it back (its tail may lend again)
    assert all(step.records == 16 for step in run.steps)  # every trajectory, one record


def test_the_pool_stays_put_when_training_ends_before_the_tail() -> None:
    run = run_config(tiny(), "libra")
    assert all(step.borrows == step.releases == 0 for step in run.steps)
    assert all(step.records == 16 for step in run.steps)


def test_a_scripts_turns_are_decoded_on_the_context_before_each() -> None:
    """The scripted demand's decode context: each turn's output on the prompt, earlier
    outputs and tool returns before it, plus half its own (as a record's loss mask gives)."""
    turns = (ScriptTurn(100, "run", output_chars=10_000), ScriptTurn(100))
    script = TrajectoryScript("swe-drift", 0, 0, 0, 1_000, 0.5, False, turns, 60.0)
    demand = demand_of_scripts([script])
    assert demand.context_tokens == (11_200,)
    assert demand.decode_context_tokens == ((1_050 + 11_150) / 2,)


def test_the_step_swing_compares_calibrated_steps_of_one_layout() -> None:
    """How far a step moves from the one before when nothing was moved: the first step
    (priced by the prior) and a change of layout do not count."""

    def step(k: int, train: int, tps: tuple[int, ...], rollout_s: float) -> StepResult:
        return StepResult(k, train, tps, rollout_s, 50.0, 0.0, 1_000, 1.0)

    steps = [step(1, 6, (4, 4, 2), 10.0), step(2, 6, (4, 4, 2), 100.0),
             step(3, 6, (4, 4, 2), 120.0), step(4, 5, (4, 4, 2, 1), 200.0),
             step(5, 5, (4, 4, 2, 1), 180.0)]  # fmt: skip
    assert _swing(ConfigRun("libra", 16, steps, [])) == pytest.approx(0.2)
    assert _swing(ConfigRun("libra", 16, steps[:2], [])) is None


def test_a_layout_reads_back_from_its_name_and_every_layout_holds_the_training_state() -> None:
    plan = parse_layout("5T/2xTP4+1xTP2+1xTP1")
    assert (plan.train_workers, plan.rollout_tps) == (5, (4, 4, 2, 1))
    assert layout_name(5, (1, 4, 2, 4)) == "5T/2xTP4+1xTP2+1xTP1"
    with pytest.raises(ValueError, match="like 5T/2xTP4"):
        parse_layout("5 training, 2 TP4")
    fleet = load_fleet()
    layouts = list(every_layout(fleet.gpu, fleet.model, 8))
    fits = TrainCost(fleet.gpu, fleet.model.parameters).fits
    assert all(plan.workers == 8 and fits(plan.train_workers) for plan in layouts)
    names = {layout_name(plan.train_workers, plan.rollout_tps) for plan in layouts}
    assert len(names) == len(layouts) and "4T/1xTP4" in names and "4T/4xTP1" in names
    # Three A100s cannot hold a 14B model's training state.
    assert not fits(3) and min(plan.train_workers for plan in layouts) == 4


@pytest.mark.slow
def test_the_layouts_held_for_the_run_give_the_best_in_hindsight() -> None:
    held = (parse_layout("4T/1xTP4"), parse_layout("4T/2xTP2"))
    settings = replace(tiny(), layouts=held)
    runs = run_alloc_bench(settings, ["static-2:2", "4T/1xTP4", "4T/2xTP2"])
    _, tp4, tp2 = runs
    assert all((s.train_workers, s.rollout_tps) == (4, (4,)) for s in tp4.steps)
    assert all((s.train_workers, s.rollout_tps) == (4, (2, 2)) for s in tp2.steps)
    report = summary(runs)["held_layouts"]
    assert report["layouts"] == 2
    assert report["best_run"] == min(tp4, tp2, key=lambda run: run.seconds).config
    assert report["best_per_step_s"] == [
        round(min(a.step_s, b.step_s), 1) for a, b in zip(tp4.steps, tp2.steps, strict=True)
    ]
    assert report["best_per_step"][0] in {"4T/1xTP4", "4T/2xTP2"}
    assert report["best_per_step_vs_static_upfront"] > 0
    # Routed by the oracle (C-MLFQ's rule told each trajectory's future) instead.
    oracle = run_config(replace(settings, layout_policy="oracle"), "4T/2xTP2")
    assert all(step.records == 16 for step in oracle.steps)
    assert [s.rollout_tps for s in oracle.steps] == [(2, 2), (2, 2)]


def test_a_layout_of_other_workers_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "alloc", "--gpus", "8", "--layouts", "4T/1xTP4,5T/1xTP4", "--jobs", "1"]
    assert main(argv) == 2
    assert "layout 5T/1xTP4 has 9 workers, not --gpus 8" in capsys.readouterr().err
