"""``libra bench``: measurements printed side by side, measured in one run."""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import asdict
from functools import partial

import anyio
from rich.console import Console
from rich.table import Table

from libra.bench import (
    ABLATIONS,
    DEFAULT_FLEET,
    DEFAULT_MISMATCH,
    DEFAULT_WORKLOAD,
    MISMATCH_PRESETS,
    POLICIES,
    add_alloc_arguments,
    add_docs_arguments,
    add_soak_arguments,
    bench_sandbox,
    bench_serve,
    bench_sync,
    bench_train,
    default_jobs,
    engine_as_json,
    main_alloc,
    main_docs,
    main_sched,
    main_soak,
    run_engine_bench,
    run_view_bench,
    serve_as_json,
    train_as_json,
    view_as_json,
)


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser("bench", help="benchmarks")
    benches = parser.add_subparsers(title="benchmarks", metavar="BENCH", required=True)
    engine = benches.add_parser("engine", help="engine overhead vs bare clients")
    engine.add_argument(
        "--concurrency",
        type=int,
        nargs="+",
        default=[1000, 10000],
        help="concurrent trajectories per level (default 1000 10000)",
    )
    engine.add_argument(
        "--pairs",
        type=int,
        default=3,
        help="runs of the engine and the bare clients per level, back to back (default 3)",
    )
    engine.add_argument("--json", action="store_true", help="print JSON instead of a table")
    engine.add_argument(
        "--view",
        action="store_true",
        help="instead: the engine with the live view on and off, pair by pair",
    )
    engine.set_defaults(run=run_engine)
    sched = benches.add_parser(
        "sched", help="scheduling policies (C-MLFQ and baselines) on an emulated fleet"
    )
    _add_sched_arguments(sched)
    sched.set_defaults(run=main_sched)
    alloc = benches.add_parser(
        "alloc", help="worker splits (static, colocated, planner, Libra) on an emulated RL run"
    )
    add_alloc_arguments(alloc)
    alloc.set_defaults(run=main_alloc)
    soak = benches.add_parser(
        "soak", help="many emulated trajectories under random faults: none lost or duplicated"
    )
    add_soak_arguments(soak)
    soak.set_defaults(run=main_soak)
    sandbox = benches.add_parser("sandbox", help="tool-call latency and throughput in sandboxes")
    sandbox.add_argument("--provider", choices=["docker", "bwrap"], default="docker")
    sandbox.add_argument("--concurrency", type=int, nargs="+", default=[8, 32])
    sandbox.add_argument("--calls", type=int, default=256, help="calls per concurrency level")
    sandbox.add_argument("--json", action="store_true", help="print JSON instead of a table")
    sandbox.set_defaults(run=run_sandbox)
    serve = benches.add_parser(
        "serve", help="libra serve's added latency and its request rate, vs direct calls"
    )
    serve.add_argument("--concurrency", type=int, nargs="+", default=[1, 64, 512])
    serve.add_argument("--seconds", type=float, default=3.0, help="per level, path and run")
    serve.add_argument(
        "--pairs", type=int, default=3, help="runs of each path per level, back to back (default 3)"
    )
    serve.add_argument("--json", action="store_true", help="print JSON instead of a table")
    serve.set_defaults(run=run_serve)
    train = benches.add_parser(
        "train", help="FSDPTrainer tokens/s vs a plain torch loop, and weight export s/step"
    )
    train.add_argument("--model", help="Hugging Face model folder (default: the embedded model)")
    train.add_argument("--steps", type=int, default=3, help="timed steps, after one warm-up")
    train.add_argument("--groups", type=int, default=4, help="GRPO groups per batch")
    train.add_argument("--per-group", type=int, default=4, help="samples per group")
    train.add_argument("--ranks", type=int, nargs="+", default=[1, 2], help="FSDP world sizes")
    train.add_argument("--micro-batch-tokens", type=int, default=1024)
    train.add_argument(
        "--long",
        type=int,
        nargs="+",
        default=[],
        help="sample lengths to train with the LM head whole and in chunks, e.g. 2048 8192",
    )
    train.add_argument("--chunk-tokens", type=int, default=1024, help="the --long rows' chunks")
    train.add_argument(
        "--syncs",
        type=int,
        default=3,
        help="timed weight syncs per transport (disk, gloo) into a real vLLM; 0: none",
    )
    train.add_argument("--json", action="store_true", help="print JSON instead of a table")
    train.set_defaults(run=run_train)
    docs = benches.add_parser(
        "docs", help="write the docs' benchmark tables from saved runs (docs/bench/)"
    )
    add_docs_arguments(docs)
    docs.set_defaults(run=main_docs)


def _add_sched_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--workload",
        default=DEFAULT_WORKLOAD,
        help=f"a shipped workload or a workload TOML file (default {DEFAULT_WORKLOAD})",
    )
    parser.add_argument(
        "--policies",
        default="",
        help=f"comma-separated, from {', '.join(POLICIES)} (default: all but the "
        "ablations and the oracles other than oracle)",
    )
    parser.add_argument(
        "--fleet",
        default=DEFAULT_FLEET,
        help=f"a shipped fleet or a fleet TOML file (default {DEFAULT_FLEET})",
    )
    presets = "; ".join(f"{name}: {text}" for name, text in MISMATCH_PRESETS.items())
    presets = presets.replace("%", "%%")  # argparse formats help strings with %
    parser.add_argument(
        "--mismatch",
        default=DEFAULT_MISMATCH,
        choices=list(MISMATCH_PRESETS),
        metavar="PRESET",
        help="how the emulated servers really perform while the scheduler keeps the "
        f"datasheet roofline as its cost model ({presets}; default {DEFAULT_MISMATCH})",
    )
    ablations = "; ".join(f"{name}: without {what}" for name, what in ABLATIONS.items())
    parser.add_argument(
        "--ablate",
        action="store_true",
        help=f"add C-MLFQ with one mechanism taken out ({ablations})",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the run (default 0)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--plot", metavar="FILE.png", help="draw occupancy and makespans")
    parser.add_argument(
        "--cmlfq",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="tune cmlfq (a CMLFQConfig setting, e.g. tree.quantile=0.97; repeatable): "
        "a variant measured against the same baselines",
    )
    parser.add_argument(
        "--trace",
        action="store_true",
        help="tell each policy's last trajectory call by call: where it went, why, and the "
        "remaining output the policy expected against the truth",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=default_jobs(),
        help="policies run in parallel processes; the numbers do not change "
        f"(default {default_jobs()}: the CPUs, up to 4)",
    )


def run_engine(args: argparse.Namespace) -> int:
    if args.view:
        return run_engine_view(args)
    results = anyio.run(
        partial(run_engine_bench, tuple(args.concurrency), pairs=args.pairs),
        backend_options={"use_uvloop": True},
    )
    if args.json:
        print(json.dumps(engine_as_json(results)))
        return 0
    table = Table(title="libra bench engine: zero-latency emulated server on a real port")
    columns = ("concurrent", "traj/s", "calls/s", "aiohttp calls/s", "ratio",
               "httptools calls/s", "ratio", "httpx calls/s", "CPU µs/call",
               "aiohttp CPU µs/call", "httptools CPU µs/call", "errors")  # fmt: skip
    for column in columns:
        table.add_column(column, justify="right")
    for r in results:
        table.add_row(
            f"{r.concurrency:,}", f"{r.trajectories_s:,.0f}", f"{r.calls_s:,.0f}",
            f"{r.bare_aiohttp_calls_s:,.0f}", f"{statistics.median(r.calls_ratio_per_pair):.2f}",
            f"{r.bare_httptools_calls_s:,.0f}",
            f"{statistics.median(r.httptools_calls_ratio_per_pair):.2f}",
            f"{r.bare_httpx_calls_s:,.0f}", f"{r.cpu_us_per_call:,.0f}",
            f"{r.bare_aiohttp_cpu_us_per_call:,.0f}", f"{r.bare_httptools_cpu_us_per_call:,.0f}",
            f"{r.errors}",
        )  # fmt: skip
    Console().print(table)
    return 0


def run_engine_view(args: argparse.Namespace) -> int:
    views = anyio.run(
        partial(run_view_bench, tuple(args.concurrency), pairs=args.pairs),
        backend_options={"use_uvloop": True},
    )
    if args.json:
        print(json.dumps(view_as_json(views)))
        return 0
    table = Table(title="libra bench engine --view: the live view on and off, pair by pair")
    for column in (
        "concurrent",
        "calls/s",
        "with the view",
        "ratio (median)",
        "per pair",
        "events",
    ):
        table.add_column(column, justify="right")
    for r in views:
        table.add_row(
            f"{r.concurrency:,}", f"{r.calls_s:,.0f}", f"{r.view_calls_s:,.0f}", f"{r.ratio:.3f}",
            " ".join(f"{x:.3f}" for x in r.ratio_per_pair), f"{r.events:,}",
        )  # fmt: skip
    Console().print(table)
    return 0


def run_serve(args: argparse.Namespace) -> int:
    results = bench_serve(tuple(args.concurrency), args.seconds, pairs=args.pairs)
    if args.json:
        print(json.dumps(serve_as_json(results)))
        return 0
    table = Table(title="libra bench serve: zero-latency emulated server, direct vs gateway")
    columns = ("sessions", "direct req/s", "gateway req/s", "direct p50 ms", "gateway p50 ms",
               "added p50 ms", "added p99 ms", "server CPU µs/req", "gateway CPU µs/req",
               "errors")  # fmt: skip
    for column in columns:
        table.add_column(column, justify="right")
    for r in results:
        table.add_row(
            f"{r.concurrency:,}", f"{r.direct.requests_s:,.0f}", f"{r.gateway.requests_s:,.0f}",
            f"{r.direct.p50_ms:.2f}", f"{r.gateway.p50_ms:.2f}", f"{r.added_p50_ms:.2f}",
            f"{r.added_p99_ms:.2f}", f"{r.direct.server_cpu_us:,.0f}",
            f"{r.gateway.server_cpu_us:,.0f}", f"{r.direct.errors + r.gateway.errors}",
        )  # fmt: skip
    Console().print(table)
    return 0


def run_sandbox(args: argparse.Namespace) -> int:
    report = anyio.run(bench_sandbox, args.provider, tuple(args.concurrency), args.calls)
    if args.json:
        print(json.dumps(report))
        return 0
    table = Table(title=f"libra bench sandbox: {report['call']} in {report['provider']}")
    for column in ("measure", "calls/s", "p50 s", "p95 s"):
        table.add_column(column, justify="right")
    table.add_row("cold sandbox + call", "", f"{report['cold_s']['p50_s']:.3f}",
                  f"{report['cold_s']['p95_s']:.3f}")  # fmt: skip
    table.add_row("warm pool call", "", f"{report['warm_exec_s']['p50_s']:.3f}",
                  f"{report['warm_exec_s']['p95_s']:.3f}")  # fmt: skip
    for level, row in report["throughput"].items():
        table.add_row(f"{level} concurrent", f"{row['calls_per_s']:.1f}", f"{row['p50_s']:.3f}",
                      f"{row['p95_s']:.3f}")  # fmt: skip
    Console().print(table)
    return 0


def run_train(args: argparse.Namespace) -> int:
    from pathlib import Path

    from libra.serving import prepare_model

    model_dir = Path(args.model) if args.model else prepare_model()
    results = bench_train(
        model_dir,
        steps=args.steps,
        groups=args.groups,
        per_group=args.per_group,
        ranks=tuple(args.ranks),
        micro_batch_tokens=args.micro_batch_tokens,
        long=tuple(args.long),
        chunk_tokens=args.chunk_tokens,
    )
    report = train_as_json(results)
    transports = anyio.run(bench_sync, model_dir, args.syncs) if args.syncs else []
    report["transports"] = [asdict(t) for t in transports]
    if args.json:
        print(json.dumps(report))
        return 0
    table = Table(title=f"libra bench train: {model_dir.name}, {report['device']}")
    columns = ("trainer", "ranks", "tokens/step", "s/step", "tokens/s", "ratio", "export s")
    for column in (*columns, "peak memory GB"):
        table.add_column(column, justify="right")
    for row in report["results"]:
        export, memory = row["export_s"], row["peak_rss_gb"]
        table.add_row(
            row["name"], str(row["ranks"]), f"{row['tokens_per_step']:,}", f"{row['step_s']:.2f}",
            f"{row['tokens_per_s']:,.0f}", f"{row['ratio_to_plain']:.2f}",
            "" if export is None else f"{export:.2f}", "" if memory is None else f"{memory:.1f}",
        )  # fmt: skip
    Console().print(table)
    if transports:
        syncs = Table(title="weight sync into vLLM, by transport")
        for column in ("transport", "MB", "sync s", "export s"):
            syncs.add_column(column, justify="right")
        for t in transports:
            export = "" if t.export_s is None else f"{t.export_s:.2f}"
            syncs.add_row(t.transport, f"{t.megabytes:,.0f}", f"{t.sync_s:.2f}", export)
        Console().print(syncs)
    return 0
