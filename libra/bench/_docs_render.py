"""How each documented benchmark's saved outputs read as markdown (``libra bench docs``).

A renderer takes the JSON outputs of its commands, in the commands' order, and returns the
lines of its region in a docs page. The scheduling tables are in ``_docs_render_sched``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from statistics import median
from typing import Any

Output = dict[str, Any]


def table_lines(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    align = ["---" if i == 0 else "---:" for i in range(len(header))]
    return [_line(header), _line(align), *(_line(row) for row in rows)]


def _line(cells: Sequence[str]) -> str:
    return "| " + " | ".join(cells) + " |"


# ------------------------------------------------------------ one command, one table


def soak(outputs: Sequence[Output]) -> list[str]:
    output = outputs[0]
    marks = ", ".join(str(mb) for mb in output.get("rss_mb_at_each_tenth", []))
    lines = ["```json", json.dumps(output), "```"]
    return [*lines, "", f"RSS at each tenth of the trajectories (MB): {marks}."] if marks else lines


def alloc(outputs: Sequence[Output]) -> list[str]:
    output = outputs[0]
    results = output["results"]
    libra = next(r for r in results if r["config"] == "libra")
    layouts = output.get("layouts", {})
    rows = [
        [
            r["config"],
            f"{r['step_time_s']:.1f}",
            f"{r['throughput_tok_s']:,.0f}",
            f"{r['idle_frac']:.2f}",
            f"{libra['throughput_tok_s'] / r['throughput_tok_s']:.2f}",
            " ".join(layouts.get(r["config"], [])),
        ]
        for r in results
    ]
    vs = output["libra_vs"]
    header = ("config", "step s", "tokens trained/s", "idle", "libra x", "layouts")
    return [
        *table_lines(header, rows),
        "",
        f"libra's throughput over the static split chosen up front: {vs['static_upfront']}x, "
        f"over the best static split in hindsight: {vs['static_best_hindsight']}x, over "
        f"colocated: {vs['colocated']}x, over libra-no-pool: {vs['libra_no_pool']}x; its "
        f"largest calibrated plan error: {output['plan_error_max']:.1%}.",
        *_alloc_bound(output),
        *_alloc_details(output),
        "",
        # The pages sit a folder below docs/, where the figures are.
        "![workers training over time and step times per configuration](../bench-alloc.png)",
    ]


#: The restated goals for full Libra on every seed: its largest calibrated plan error at
#: most this, and at least this share of what no split and no routing can beat.
GOAL_PLAN_ERROR, GOAL_OF_BOUND = 0.15, 0.66


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def alloc_seeds(outputs: Sequence[Output]) -> list[str]:
    """Full Libra seed by seed (of each workload): over the split chosen up front and the
    best static split in hindsight, its share of the bound, its plan error, and what the
    elastic pool buys (over ``libra-no-pool``); then the restated goals, met or not."""
    rows, checks = [], {"plan error": True, "static": True, "bound": True}
    for output in outputs:
        vs, results = output["libra_vs"], output["results"]
        statics = [r for r in results if r["config"].startswith("static-")]
        best = max(statics, key=lambda r: r["throughput_tok_s"])["config"]
        of_bound = vs["static_upfront"] / output["bound_vs_static_upfront"]
        pool = output["pool"].get("libra", {})
        checks["plan error"] &= output["plan_error_max"] <= GOAL_PLAN_ERROR
        checks["static"] &= vs["static_best_hindsight"] > 1
        checks["bound"] &= of_bound >= GOAL_OF_BOUND
        rows.append(
            [
                output["workload"],
                f"{output['seed']}",
                f"{vs['static_upfront']:.3f}",
                f"{vs['static_best_hindsight']:.3f} ({best})",
                f"{of_bound:.0%}",
                f"{output['plan_error_max']:.1%}",
                _percent(output.get("step_swing_max")),
                f"{vs['libra_no_pool']:.3f}",
                f"{pool.get('borrows', 0)} / {pool.get('releases', 0)}",
                _drift(output.get("upfront_rollout_over_train") or []),
            ]
        )
    header = ("workload", "seed", "x upfront split", "x best static (which)", "of the bound",
              "plan error", "step swing, one layout", "pool: x libra-no-pool", "borrows / releases",
              "rollout / training, first to last step")  # fmt: skip
    goals: list[tuple[str, bool]] = [
        (f"largest calibrated plan error at most {GOAL_PLAN_ERROR:.0%}", checks["plan error"]),
        ("ahead of the best static split in hindsight", checks["static"]),
        (f"at least {GOAL_OF_BOUND:.0%} of the bound", checks["bound"]),
    ]
    return [
        *table_lines(header, rows),
        "",
        *table_lines(
            ("goal, on every run", "met"),
            [[name, "yes" if met else "**no**"] for name, met in goals],
        ),
    ]


def _drift(ratios: Sequence[float]) -> str:
    """How the split chosen up front's rollout/training ratio moved over the run."""
    return f"{ratios[0]:.2f} to {ratios[-1]:.2f}" if ratios else ""


def alloc_layouts(outputs: Sequence[Output]) -> list[str]:
    """Full Libra beside the layouts held for the whole run (``--layouts``, routed as
    ``--layouts-routing`` says): the fastest of them, and the fastest at each step in
    hindsight, each over the split chosen up front and as a share of the bound."""
    rows = []
    for output in outputs:
        held, bound = output["held_layouts"], output["bound_vs_static_upfront"]
        libra = output["libra_vs"]["static_upfront"]
        best = held["best_run_vs_static_upfront"]
        per_step = held["best_per_step_vs_static_upfront"]
        picks = ", ".join(dict.fromkeys(held["best_per_step"]))
        rows.append(
            [
                f"{output['workload']}",
                f"{output['seed']}",
                f"{held['layouts']}",
                output.get("layouts_routing", "cmlfq"),
                f"{libra:.3f} ({libra / bound:.1%})",
                f"{best:.3f} ({best / bound:.1%}, {held['best_run']})",
                f"{per_step:.3f} ({per_step / bound:.1%}; {picks})",
            ]
        )
    header = ("workload", "seed", "layouts held", "routed by", "libra: x upfront (of the bound)",
              "fastest layout held for the run",
              "fastest layout of each step, in hindsight")  # fmt: skip
    return table_lines(header, rows)


def alloc_ahead(outputs: Sequence[Output]) -> list[str]:
    output = outputs[0]
    rows = [
        [
            r["mode"],
            f"{r['step_time_s']:.1f}",
            f"{r['trainer_idle_frac']:.1%}",
            f"{r['serving_idle_frac']:.1%}",
            f"{r['throughput_tok_s']:,.0f}",
            f"{r['behind_mean']:.2f} / {r['behind_max']}",
        ]
        for r in output["results"]
    ]
    header = ("mode", "step s", "trainer idle", "serving idle", "tokens trained/s", "behind")
    vs = output["vs_one_step_off"]
    return [
        *table_lines(header, rows),
        "",
        *(
            f"async with max_ahead {k} against one-step-off: {ratio['trainer_idle']}x its "
            f"trainer idle share, {ratio['throughput']}x its tokens trained per second."
            for k, ratio in vs.items()
        ),
    ]


def _alloc_bound(output: Output) -> list[str]:
    lines = []
    if (packed := output.get("libra_no_idle_vs_static_upfront")) is not None:
        lines += [
            "",
            f"The most a better packing of libra's work could buy: that work (its busy "
            f"worker-seconds) with no worker ever idle would train {packed}x the tokens "
            f"per second of the upfront split.",
        ]
    if (bound := output.get("bound_vs_static_upfront")) is not None:
        lines += [
            "",
            f"What no split and no routing can beat (`step_bounds`: every step's decode in "
            f"full batches on its most efficient instance size, training on the fewest "
            f"workers that hold its state, no worker ever idle, nor faster than the longest "
            f"trajectory alone): {bound}x the upfront split.",
        ]
    return lines


def _alloc_details(output: Output) -> list[str]:
    """The planners' errors and what the pool did (a layout ``5T/2xTP4+1xTP1`` is 5 workers
    training and those instances serving)."""
    errors = ", ".join(f"{c} {e:.1%}" for c, e in output["plan_error_max_by_config"].items())
    lines = [
        "",
        f"Largest calibrated plan error (predicted / measured - 1, every step after the "
        f"first): {errors}; the cost model on the workload as it turned out: "
        f"{output['model_error_max']:.1%}.",
    ]
    pool = output["pool"].get("libra")
    if pool:
        workers = ", ".join(f"{n:.1f}" for n in pool["mean_train_workers"])
        lines += [
            "",
            f"libra's pool: {pool['borrows']} borrows and {pool['releases']} releases; workers "
            f"training per step, on average: {workers}; its serving workers idle "
            f"{output['rollout_idle_frac']['libra']:.0%} of the rollout (libra-no-pool: "
            f"{output['rollout_idle_frac']['libra-no-pool']:.0%}).",
        ]
    return lines


def engine(outputs: Sequence[Output]) -> list[str]:
    rows = [
        [
            f"{r['concurrency']:,}",
            f"{r['trajectories_s']:,.0f}",
            f"{r['calls_s']:,.0f}",
            f"{r['bare_aiohttp_calls_s']:,.0f}",
            _median_and_range(r["calls_ratio_per_pair"]),
            f"{r['bare_httpx_calls_s']:,.0f}",
            f"{r['cpu_us_per_call']:,.0f}",
            f"{r['bare_aiohttp_cpu_us_per_call']:,.0f}",
            _median_and_range(r["cpu_ratio_per_pair"]),
            *_own_transport(r),
            f"{r['errors']}",
        ]
        for r in outputs[0]["results"]
    ]
    header = (
        "concurrent trajectories",
        "engine traj/s",
        "engine calls/s",
        "bare aiohttp calls/s",
        "ratio (its pairs)",
        "bare httpx calls/s",
        "engine CPU µs/call",
        "bare aiohttp CPU µs/call",
        "CPU ratio (its pairs)",
        "bare httptools calls/s",
        "ratio to it",
        "bare httptools CPU µs/call",
        "CPU ratio to it",
        "errors",
    )
    return table_lines(header, rows)


def _own_transport(r: Mapping[str, Any]) -> list[str]:
    """The engine beside its own transport alone (runs saved before it was measured: -)."""
    if "bare_httptools_calls_s" not in r:
        return ["-"] * 4
    return [
        f"{r['bare_httptools_calls_s']:,.0f}",
        _median_and_range(r["httptools_calls_ratio_per_pair"]),
        f"{r['bare_httptools_cpu_us_per_call']:,.0f}",
        _median_and_range(r["httptools_cpu_ratio_per_pair"]),
    ]


def _median_and_range(pairs: Sequence[float], shown: float | None = None) -> str:
    """A level's figure (by default the median of its pairs), and its pairs' range."""
    shown = median(pairs) if shown is None else shown
    return f"{shown:.2f} ({min(pairs):.2f} to {max(pairs):.2f})"


def serve(outputs: Sequence[Output]) -> list[str]:
    rows = [
        [
            f"{level['concurrency']:,}",
            f"{level['direct']['requests_s']:,.0f}",
            f"{level['gateway']['requests_s']:,.0f}",
            _median_and_range(level["added_p50_ms_per_pair"], level["added_p50_ms"]),
            f"{level['added_p99_ms']:.2f}",
            f"{level['direct']['server_cpu_us']:,.0f}",
            f"{level['gateway']['server_cpu_us']:,.0f}",
        ]
        for level in outputs[0]["levels"]
    ]
    header = (
        "sessions",
        "direct req/s",
        "gateway req/s",
        "added p50 ms (its pairs)",
        "added p99 ms",
        "server CPU µs/req",
        "gateway CPU µs/req",
    )
    return table_lines(header, rows)


def train(outputs: Sequence[Output]) -> list[str]:
    rows = [
        [
            row["name"],
            str(row["ranks"]),
            f"{row['tokens_per_step']:,}",
            f"{row['step_s']:.2f}",
            f"{row['tokens_per_s']:,.0f}",
            f"{row['ratio_to_plain']:.2f}",
            "" if row["export_s"] is None else f"{row['export_s']:.2f}",
            "" if row.get("peak_rss_gb") is None else f"{row['peak_rss_gb']:.1f}",
        ]
        for row in outputs[0]["results"]
    ]
    header = (
        "trainer",
        "ranks",
        "tokens/step",
        "s/step",
        "tokens/s",
        "x plain loop",
        "export s",
        "peak memory GB",
    )
    lines = table_lines(header, rows)
    transports = outputs[0].get("transports") or []
    if transports:
        syncs = [
            [
                t["transport"],
                f"{t['megabytes']:,.0f}",
                f"{t['sync_s']:.2f}",
                "" if t["export_s"] is None else f"{t['export_s']:.2f}",
            ]
            for t in transports
        ]
        lines += ["", *table_lines(("weight transport", "MB", "sync s", "export s"), syncs)]
    return lines


# ------------------------------------------------------------------- scheduling


def engine_view(outputs: Sequence[Output]) -> list[str]:
    rows = [
        [
            f"{r['concurrency']:,}",
            f"{r['trajectories']:,}",
            f"{r['calls_s']:,.0f}",
            f"{r['view_calls_s']:,.0f}",
            _median_and_range(r["ratio_per_pair"], r["ratio"]),
            f"{r['events']:,}",
        ]
        for r in outputs[0]["results"]
    ]
    header = (
        "concurrent trajectories",
        "trajectories",
        "calls/s without the view",
        "calls/s with it",
        "ratio (its pairs)",
        "events a run",
    )
    return table_lines(header, rows)
