"""``libra bench alloc``'s command line, table, JSON and figure."""

from __future__ import annotations

import argparse
import json
import sys
from itertools import pairwise
from typing import Any

from rich.console import Console
from rich.table import Table

from libra.alloc import Plan
from libra.bench._alloc import ConfigRun, config_names, run_alloc_bench
from libra.bench._alloc_ahead import print_table as print_ahead
from libra.bench._alloc_ahead import run_ahead
from libra.bench._alloc_ahead import summary as ahead_summary
from libra.bench._alloc_bound import step_bounds
from libra.bench._alloc_settings import Settings
from libra.bench._alloc_strategies import (
    UPFRONT_SHARE,
    every_layout,
    layout_name,
    parse_layout,
    static_name,
)
from libra.bench._sched import default_jobs
from libra.bench._sched_fleet import DEFAULT_FLEET, FleetFile, load_fleet
from libra.emulation.workloads import WorkloadError, load_workload

DEFAULT_WORKLOAD = "swe-drift"
LIBRA = "libra"


def summary(runs: list[ConfigRun], bounds: list[float] | None = None) -> dict[str, Any]:
    """The JSON report: per configuration, and full Libra's throughput over the baselines;
    with ``bounds`` (:func:`~libra.bench._alloc_bound.step_bounds`), what no split can beat."""
    by_name = {run.config: run for run in runs}
    statics = [run for run in runs if run.config.startswith("static-")]
    libra = by_name.get(LIBRA)

    def ratio(other: ConfigRun | None) -> float | None:
        if libra is None or other is None:
            return None
        return round(libra.throughput_tok_s / other.throughput_tok_s, 3)

    best = max(statics, key=lambda run: run.throughput_tok_s, default=None)
    upfront = by_name.get(static_name(UPFRONT_SHARE))
    calibrated = libra.plan_errors[1:] if libra is not None else []
    model = libra.model_errors[1:] if libra is not None else []
    return {
        "results": [
            {
                "config": run.config,
                "step_time_s": round(run.step_time_s, 2),
                "throughput_tok_s": round(run.throughput_tok_s, 1),
                "idle_frac": round(run.idle_frac, 4),
            }
            for run in runs
        ],
        "libra_vs": {
            "static_upfront": ratio(upfront),
            "static_best_hindsight": ratio(best),
            "colocated": ratio(by_name.get("colocated")),
            "libra_no_pool": ratio(by_name.get("libra-no-pool")),
        },
        # What no split of libra's work can beat: that work with no worker ever idle.
        "libra_no_idle_vs_static_upfront": (
            round(libra.throughput_tok_s / (1 - libra.idle_frac) / upfront.throughput_tok_s, 3)
            if libra is not None and upfront is not None
            else None
        ),
        # What no split and no routing can beat, with the truth's costs: the bound's
        # throughput (the same tokens over the bound's step times) over the upfront split's.
        "bound_vs_static_upfront": (
            round(_bound_throughput(upfront, bounds) / upfront.throughput_tok_s, 3)
            if bounds and upfront is not None
            else None
        ),
        "plan_error_max": round(max(map(abs, calibrated)), 4) if calibrated else None,
        # What the step's own draw moves: libra's step over the one before it, where the
        # layout stayed (a forecast from past steps cannot know where the longest land).
        "step_swing_max": _swing(libra) if libra is not None else None,
        "layouts": {run.config: _layouts(run) for run in runs},
        "plan_error_max_by_config": {
            run.config: round(max(map(abs, run.plan_errors[1:])), 4)
            for run in runs
            if len(run.plan_errors) > 1
        },
        "pool": {
            run.config: {
                "borrows": sum(step.borrows for step in run.steps),
                "releases": sum(step.releases for step in run.steps),
                "mean_train_workers": [round(step.mean_train_workers, 2) for step in run.steps],
            }
            for run in runs
            if any(step.borrows or step.releases for step in run.steps)
        },
        # How the workload drifts: the split chosen up front's rollout over its training,
        # step by step (one layout throughout, so only the workload moves it).
        "upfront_rollout_over_train": (
            [round(step.rollout_s / step.train_s, 3) for step in upfront.steps if step.train_s]
            if upfront is not None
            else None
        ),
        # Each configuration's steps: rollout and training seconds, and workers training.
        "steps": {
            run.config: [
                {
                    "rollout_s": round(step.rollout_s, 1),
                    "train_s": round(step.train_s, 1),
                    "train_workers": round(step.mean_train_workers, 2),
                }
                for step in run.steps
            ]
            for run in runs
        },
        "rollout_idle_frac": {
            run.config: round(run.rollout_idle_frac, 4) for run in runs if not _colocated(run)
        },
        "model_error_max": round(max(map(abs, model)), 4) if model else None,
        "plan_errors": {
            run.config: [round(error, 4) for error in run.plan_errors]
            for run in runs
            if run.plan_errors
        },
        "model_errors": {
            run.config: [round(error, 4) for error in run.model_errors]
            for run in runs
            if run.model_errors
        },
        "held_layouts": _held(runs, upfront),
    }


def _held(runs: list[ConfigRun], upfront: ConfigRun | None) -> dict[str, Any] | None:
    """The layouts held for a whole run (``--layouts``): the fastest of them, and the
    fastest of them at each step, in hindsight, with each one's throughput over the
    upfront split's (the per-step pick trains the upfront split's tokens, as the bound
    does, and pays no move)."""
    held = [run for run in runs if _held_layout(run.config)]
    if not held or upfront is None:
        return None
    whole = min(held, key=lambda run: run.seconds)
    per_step = [min(held, key=lambda run: run.steps[k].step_s) for k in range(len(upfront.steps))]
    per_step_s = [run.steps[k].step_s for k, run in enumerate(per_step)]
    upfront_tokens = sum(step.train_tokens for step in upfront.steps)
    return {
        "layouts": len(held),
        "best_run": whole.config,
        "best_run_vs_static_upfront": round(whole.throughput_tok_s / upfront.throughput_tok_s, 3),
        "best_per_step": [run.config for run in per_step],
        "best_per_step_s": [round(seconds, 1) for seconds in per_step_s],
        "best_per_step_vs_static_upfront": round(
            upfront_tokens / sum(per_step_s) / upfront.throughput_tok_s, 3
        ),
    }


def _held_layout(config: str) -> bool:
    try:
        parse_layout(config)
    except ValueError:
        return False
    return True


def _bound_throughput(run: ConfigRun, bounds: list[float]) -> float:
    return sum(step.train_tokens for step in run.steps) / sum(bounds)


def _colocated(run: ConfigRun) -> bool:
    return any(step.colocated for step in run.steps)


def print_table(settings: Settings, runs: list[ConfigRun], bounds: list[float] | None) -> None:
    report = summary(runs, bounds)
    libra = next((run for run in runs if run.config == LIBRA), None)
    table = Table(
        title=f"libra bench alloc: {settings.workload.name}, {settings.gpus} x "
        f"{settings.fleet.gpu.name} {settings.fleet.model.name}, {settings.steps} steps, "
        f"seed {settings.seed}"
    )
    columns = (
        "config",
        "step s",
        "tok/s",
        "idle",
        "libra x",
        "layouts",
        "plan error",
        "model error",
    )
    for column in columns:
        table.add_column(column, justify="right")
    for run in runs:
        ratio = libra.throughput_tok_s / run.throughput_tok_s if libra else 0.0
        table.add_row(
            run.config, f"{run.step_time_s:.1f}", f"{run.throughput_tok_s:,.0f}",
            f"{run.idle_frac:.2f}", f"{ratio:.2f}", " ".join(_layouts(run)),
            _first_last(run.plan_errors), _first_last(run.model_errors),
        )  # fmt: skip
    console = Console()
    console.print(table)
    vs = report["libra_vs"]
    console.print(
        f"libra vs static upfront ({static_name(UPFRONT_SHARE)} at TP1) {vs['static_upfront']}x, "
        f"vs best static in hindsight {vs['static_best_hindsight']}x, "
        f"vs colocated {vs['colocated']}x, vs libra-no-pool {vs['libra_no_pool']}x; "
        f"largest calibrated plan error {report['plan_error_max']} (cost model alone, on "
        f"the workload as it turned out: {report['model_error_max']}); no split and no "
        f"routing can beat {report['bound_vs_static_upfront']}x the upfront split"
    )
    held = report["held_layouts"]
    if held is not None:
        console.print(
            f"of {held['layouts']} layouts each held for the run: the fastest, "
            f"{held['best_run']}, {held['best_run_vs_static_upfront']}x the upfront split; "
            f"the fastest at each step in hindsight {held['best_per_step_vs_static_upfront']}x"
        )


def _first_last(errors: list[float]) -> str:
    """A planner's error on its first step and on its last (after its fits)."""
    return f"{errors[0]:+.0%} -> {errors[-1]:+.0%}" if errors else ""


def _layouts(run: ConfigRun) -> list[str]:
    """The layouts the configuration's steps ran on (:func:`layout_name`)."""
    return sorted({layout_name(step.train_workers, step.rollout_tps) for step in run.steps})


def plot(runs: list[ConfigRun], path: str) -> None:
    """Workers in training over time, and every step's time, per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    figure, (split, times) = pyplot.subplots(2, 1, figsize=(10, 8))
    for run in runs:
        moments, workers, clock = [], [], 0.0
        for step in run.steps:
            moments += [clock, clock + step.step_s]
            workers += [step.train_workers, step.train_workers]
            clock += step.step_s
        split.plot(moments, workers, label=run.config)
        times.plot([step.step for step in run.steps], [s.step_s for s in run.steps], "o-")
    split.set(xlabel="time (s)", ylabel="workers training", title="the split over time")
    times.set(xlabel="RL step", ylabel="step time (s)", title="step times")
    split.legend(fontsize="small", ncol=2)
    figure.tight_layout()
    figure.savefig(path)


# ------------------------------------------------------------------- the command line


def main_alloc(args: argparse.Namespace) -> int:
    try:
        fleet = load_fleet(args.fleet)
        layouts = _held_layouts(args.layouts, fleet, args.gpus) if args.layouts else ()
        settings = Settings(
            load_workload(args.workload),
            fleet,
            args.gpus,
            args.steps,
            args.seed,
            layouts=layouts,
            layout_policy=args.layouts_routing,
        )
    except (WorkloadError, ValueError) as exc:
        print(f"libra: error: {exc}", file=sys.stderr)
        return 2
    if args.ahead:
        return _main_ahead(settings, args)
    try:
        runs = run_alloc_bench(settings, config_names(settings), jobs=args.jobs)
    except ValueError as exc:  # e.g. too few workers to hold the training state
        print(f"libra: error: {exc}", file=sys.stderr)
        return 2
    upfront = next((run for run in runs if run.config == static_name(UPFRONT_SHARE)), None)
    bounds = step_bounds(settings, upfront) if upfront is not None else None
    if args.json:
        which = {"workload": settings.workload.name, "seed": settings.seed}
        if settings.layouts:
            which["layouts_routing"] = settings.layout_policy
        print(json.dumps(which | summary(runs, bounds)))
    else:
        print_table(settings, runs, bounds)
    if args.plot:
        plot(runs, args.plot)
    return 0


def _held_layouts(spec: str, fleet: FleetFile, gpus: int) -> tuple[Plan, ...]:
    """``--layouts``: ``all`` (:func:`every_layout`) or layout names, each of ``gpus``."""
    if spec.strip() == "all":
        return tuple(every_layout(fleet.gpu, fleet.model, gpus))
    named = [parse_layout(name) for name in spec.split(",")]
    plans = tuple({(p.train_workers, p.rollout_tps): p for p in named}.values())
    for plan in plans:
        if plan.workers != gpus:
            name = layout_name(plan.train_workers, plan.rollout_tps)
            raise ValueError(f"layout {name} has {plan.workers} workers, not --gpus {gpus}")
    return plans


def _main_ahead(settings: Settings, args: argparse.Namespace) -> int:
    try:
        aheads = sorted({int(k) for k in args.ahead.split(",")})
        runs = [run_ahead(settings, ahead) for ahead in aheads]
    except ValueError:
        print(f"libra: error: --ahead takes steps of 1 or more, not {args.ahead}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(ahead_summary(runs)))
    else:
        print_ahead(settings, runs)
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--workload",
        default=DEFAULT_WORKLOAD,
        help=f"a shipped workload or a workload TOML file (default {DEFAULT_WORKLOAD})",
    )
    parser.add_argument(
        "--fleet",
        default=DEFAULT_FLEET,
        help=f"the GPU and model of a shipped fleet or fleet file (default {DEFAULT_FLEET})",
    )
    parser.add_argument("--gpus", type=int, default=16, help="workers to split (default 16)")
    parser.add_argument("--steps", type=int, default=6, help="RL steps per config (default 6)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the run (default 0)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--plot", metavar="FILE.png", help="draw the split and the step times")
    parser.add_argument(
        "--ahead",
        metavar="K[,K...]",
        help="instead of the configurations: the split chosen up front with rollouts K "
        "steps ahead of training (1: one-step-off, 2 or more: async), e.g. 1,2,3",
    )
    parser.add_argument(
        "--layouts",
        metavar="all|LAYOUT[,LAYOUT...]",
        help="also run these layouts (e.g. 6T/2xTP4+1xTP2), or 'all' the planners may "
        "choose, each held for the whole run and routed by C-MLFQ; the report adds the "
        "fastest of them, and the fastest at each step, in hindsight",
    )
    parser.add_argument(
        "--layouts-routing",
        choices=("cmlfq", "oracle"),
        default="cmlfq",
        help="how the --layouts route: C-MLFQ (default), or its rule told every "
        "trajectory's future (what better routing could still buy)",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=default_jobs(),
        help=f"configs run in parallel processes; the numbers do not change (default "
        f"{default_jobs()})",
    )


def _swing(run: ConfigRun) -> float | None:
    """The largest change of the step (its longer half) between two calibrated steps of
    one layout."""
    swings = [
        abs(max(now.rollout_s, now.train_s) / max(before.rollout_s, before.train_s) - 1)
        for before, now in pairwise(run.steps[1:])
        if (before.train_workers, before.rollout_tps) == (now.train_workers, now.rollout_tps)
    ]
    return round(max(swings), 4) if swings else None
