"""How each documented benchmark's saved outputs read as markdown (``libra bench docs``).

A renderer takes the JSON outputs of its commands, in the commands' order, and returns the
lines of its region in a docs page. The scheduling tables pick their runs by what each output says
it ran (workload, mismatch preset, seed), so a table derived from several runs (ratios of
ablations, means over seeds) is computed from the same saved outputs as the rest.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from statistics import mean, median
from typing import Any

from libra.sched.policies import ABLATIONS

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
        ]
        for row in outputs[0]["results"]
    ]
    header = ("trainer", "ranks", "tokens/step", "s/step", "tokens/s", "x plain loop", "export s")
    return table_lines(header, rows)


# ------------------------------------------------------------------- scheduling


def pick(outputs: Sequence[Output], workload: str, mismatch: str, seed: int = 0) -> Output:
    """The run of ``libra bench sched`` on ``workload`` under ``mismatch`` for ``seed``."""
    for output in outputs:
        if (output["workload"], output["mismatch"], output["seed"]) == (workload, mismatch, seed):
            return output
    raise KeyError(f"no saved run of {workload} under {mismatch}, seed {seed}")


def makespans(output: Output) -> dict[str, float]:
    return {r["policy"]: r["makespan_s"] for r in output["results"]}


def policies(outputs: Sequence[Output]) -> list[str]:
    """Every policy of the first run: its lower bound, and its table."""
    output, rows = outputs[0], []
    for r in output["results"]:
        name, makespan = r["policy"], f"{r['makespan_s']:.1f}"
        if name == "cmlfq":
            name, makespan = f"**{name}**", f"**{makespan}**"
        rows.append(
            [
                name + (f" ({r['failed']} failed)" if r["failed"] else ""),
                f"{r['throughput_traj_s']:.3f}",
                f"{r['throughput_tok_s']:,.0f}",
                makespan,
                f"{r['idle_frac']:.2f}",
                f"{r['tail_ratio']:.2f}",
                f"{r['migrations']}",
                f"{r['preemptions']}",
                _ratio(r["vs_cmlfq"], 3),
                _ratio(r["vs_oracle"], 2),
                f"{r['vs_bound']:.2f}",
            ]
        )
    header = ("policy", "traj/s", "tok/s", "makespan s", "GPU idle", "p99/p50", "migrations",
              "preempted", "x cmlfq", "x oracle", "x bound")  # fmt: skip
    bound = output["lower_bound"]
    return [
        f"{output['workload']}, mismatch `{output['mismatch']}`, seed {output['seed']}: "
        f"{output['trajectories']} trajectories, lower bound {output['lower_bound_s']:.1f} s "
        f"(the longest trajectory alone on the fastest instance {bound['chain_s']:.1f} s, "
        f"the step's decode work at the fleet's full-batch throughput {bound['work_s']:.1f} s).",
        "",
        *table_lines(header, rows),
    ]


def sched_figure(outputs: Sequence[Output]) -> list[str]:
    """The figure the run drew, under the makespans it shows."""
    output = outputs[0]
    spans = ", ".join(f"{policy} {span:.1f}" for policy, span in makespans(output).items())
    return [
        f"{output['workload']}, mismatch `{output['mismatch']}`, seed {output['seed']}; "
        f"makespans (s): {spans}.",
        "",
        # The pages sit a folder below docs/, where the figures are.
        "![per-bucket occupancy and makespan per policy](../bench-swe-agent.png)",
    ]


def one_run(workload: str, mismatch: str, outputs: Sequence[Output]) -> list[str]:
    """:func:`policies` for seed 0 of ``workload`` under ``mismatch``."""
    return policies([pick(outputs, workload, mismatch)])


def _ratio(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


#: The seed-0 table leaves out the reference's rules (they have a row in the full tables).
_WORKLOAD_COLUMNS = (
    "round-robin",
    "least-loaded",
    "least-loaded-capacity",
    "static-prompt",
    "length-pred",
    "sorted",
    "plas",
    "cmlfq",
    "cmlfq-fit",
    *ABLATIONS,
    "oracle",
)


def workloads(outputs: Sequence[Output]) -> list[str]:
    """Seed 0's makespans on every saved workload and preset."""
    rows = []
    for output in [o for o in outputs if o["seed"] == 0]:
        spans = makespans(output)
        label = f"{output['workload']}, {output['mismatch']} ({output['trajectories']})"
        rows.append(
            [label, *_bold_best(spans, _WORKLOAD_COLUMNS), f"{output['lower_bound_s']:.1f}"]
        )
    return table_lines(("workload, mismatch", *_WORKLOAD_COLUMNS, "bound"), rows)


def _bold_best(spans: dict[str, float], columns: Sequence[str]) -> list[str]:
    """Each column's makespan; the fastest of ``cmlfq`` and the baselines in bold."""
    best = round(min(spans[p] for p in columns if _contender(p)), 1)
    cells = []
    for policy in columns:
        cell = f"{spans[policy]:.1f}"
        best_here = _contender(policy) and round(spans[policy], 1) == best
        cells.append(f"**{cell}**" if best_here else cell)
    return cells


def _contender(policy: str) -> bool:
    """``cmlfq`` or a baseline: not one of its variants, not an oracle."""
    return policy == "cmlfq" or not policy.startswith(("cmlfq", "oracle"))


_SHORT = {"swe-agent": "swe", "math-code": "math", "search-agent": "search"}


def ablations(outputs: Sequence[Output]) -> list[str]:
    """Each ablation's makespan over ``cmlfq``'s on every seed-0 run, and its range and mean
    makespan over the seeds of swe-agent under ``datasheet``."""
    first = [o for o in outputs if o["seed"] == 0]
    seeds = [o for o in outputs if (o["workload"], o["mismatch"]) == ("swe-agent", "datasheet")]
    rows = []
    for name, part in ABLATIONS.items():
        ratios = [_vs_cmlfq(o, name) for o in seeds]
        over_seeds = (
            f"{min(ratios):.3f}–{max(ratios):.3f} ({mean(makespans(o)[name] for o in seeds):.1f} s "
            f"against {mean(makespans(o)['cmlfq'] for o in seeds):.1f} s)"
        )
        rows.append(
            [f"{part}: `{name}`", *(f"{_vs_cmlfq(o, name):.3f}" for o in first), over_seeds]
        )
    columns = [f"{_SHORT.get(o['workload'], o['workload'])} {o['mismatch']}" for o in first]
    span = f"{min(o['seed'] for o in seeds)}-{max(o['seed'] for o in seeds)}"
    header = ("part taken out", *columns, f"swe datasheet, seeds {span} (mean makespan)")
    return table_lines(header, rows)


def _vs_cmlfq(output: Output, policy: str) -> float:
    spans = makespans(output)
    return spans[policy] / spans["cmlfq"]


#: The seeds table leaves out the slowest baseline too (2.7x ``cmlfq`` on seed 0).
_SEED_COLUMNS = tuple(p for p in _WORKLOAD_COLUMNS if p != "static-prompt")


def seeds(
    workload: str,
    mismatch: str,
    outputs: Sequence[Output],
    columns: Sequence[str] = _SEED_COLUMNS,
) -> list[str]:
    """``workload`` under ``mismatch`` on every saved seed, the mean, the best baseline,
    ``cmlfq``'s and the oracle's makespans over it, and the requests preempted in
    ``cmlfq``'s run (where in-server priority can act); then how the ratios spread."""
    runs = [o for o in outputs if (o["workload"], o["mismatch"]) == (workload, mismatch)]
    rows, ratios, oracle_ratios = [], [], []
    for output in runs:
        spans = makespans(output)
        best = _best_baseline(spans, columns)
        ratios.append(spans["cmlfq"] / spans[best])
        oracle_ratios.append(spans["oracle"] / spans[best])
        rows.append(
            [
                f"{output['seed']}",
                *_bold_best(spans, columns),
                best,
                f"{ratios[-1]:.3f}",
                f"{oracle_ratios[-1]:.3f}",
                _cmlfq_preempted(output),
            ]
        )
    means = {p: mean(makespans(o)[p] for o in runs) for p in columns}
    best = _best_baseline(means, columns)
    preempted = mean(int(_cmlfq_preempted(o)) for o in runs)
    rows.append(
        [
            "mean",
            *_bold_best(means, columns),
            best,
            f"{means['cmlfq'] / means[best]:.3f}",
            f"{means['oracle'] / means[best]:.3f}",
            f"{preempted:.1f}",
        ]
    )
    header = (
        "seed", *columns, "best baseline", "cmlfq x best", "oracle x best", "cmlfq preempted"
    )  # fmt: skip
    within = sum(ratio <= 1.02 for ratio in ratios)
    return [
        *table_lines(header, rows),
        "",
        f"`cmlfq` over the best baseline, per seed: median {median(ratios):.3f}, best "
        f"{min(ratios):.3f}, worst {max(ratios):.3f}; best or within 2% of it on {within} "
        f"of {len(ratios)} seeds. `oracle` (the same rule knowing every trajectory's "
        f"future) over it: median {median(oracle_ratios):.3f}, best "
        f"{min(oracle_ratios):.3f}, worst {max(oracle_ratios):.3f}.",
    ]


def _cmlfq_preempted(output: Output) -> str:
    return str(next(r["preemptions"] for r in output["results"] if r["policy"] == "cmlfq"))


def _best_baseline(spans: dict[str, float], columns: Sequence[str] = _SEED_COLUMNS) -> str:
    baselines = [p for p in columns if _contender(p) and p != "cmlfq"]
    return min(baselines, key=lambda p: spans[p])


#: The columns of a run without ``--ablate``.
PLAIN_COLUMNS = tuple(p for p in _SEED_COLUMNS if p not in ABLATIONS)


def robustness(outputs: Sequence[Output]) -> list[str]:
    """How each policy fares against the best of the others on every saved run under
    ``datasheet`` (of a workload and seed saved twice, the later run: the seeds tables'):
    ``cmlfq`` and each baseline against the fastest of the rest of them, its variants and
    the oracle against the fastest baseline."""
    runs = [
        *{(o["workload"], o["seed"]): o for o in outputs if o["mismatch"] == "datasheet"}.values()
    ]
    contenders = [p for p in PLAIN_COLUMNS if _contender(p)]
    spans = [makespans(o) for o in runs]
    ratios: dict[str, list[float]] = {}
    for policy in PLAIN_COLUMNS:
        # A variant or the oracle is weighed against the baselines alone.
        rivals = [p for p in contenders if p != policy and (_contender(policy) or p != "cmlfq")]
        ratios[policy] = [s[policy] / min(s[p] for p in rivals) for s in spans]
    within = {p: sum(ratio <= 1.02 for ratio in these) for p, these in ratios.items()}
    rows = [
        [
            f"**{policy}**" if policy == "cmlfq" else policy,
            f"{sum(ratio < 1 for ratio in these)}",
            f"{within[policy]}",
            f"{median(these):.3f}",
            f"{max(these):.3f}",
        ]
        for policy, these in ratios.items()
    ]
    header = ("policy", "fastest", "within 2%", "median x the best", "worst")
    runner_up = max((p for p in contenders if p != "cmlfq"), key=lambda p: within[p])
    workloads = ", ".join(dict.fromkeys(o["workload"] for o in runs))
    seeds = sorted({o["seed"] for o in runs})
    return [
        f"The {len(runs)} runs under `datasheet` ({workloads}; seeds {seeds[0]}-{seeds[-1]});"
        " each policy's makespan over the fastest of the others' (for `cmlfq`'s variants and"
        " the oracle: of the baselines'):",
        "",
        *table_lines(header, rows),
        "",
        f"`cmlfq` is fastest or within 2% of the fastest baseline on {within['cmlfq']} of "
        f"{len(runs)} runs, worst {max(ratios['cmlfq']):.3f}; by the same measure the "
        f"strongest baseline, `{runner_up}`, on {within[runner_up]} of {len(runs)}, worst "
        f"{max(ratios[runner_up]):.3f}.",
    ]
