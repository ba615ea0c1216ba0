"""``libra bench docs``: the README's benchmark tables, written from saved runs, never by hand.

Each documented benchmark has a command (a ``libra bench ... --json`` line), a file under
``docs/bench/`` holding what that command printed (with the commit, the cores and the load
average it ran under), and a region of the README between two markers::

    <!-- bench:soak -->
    ...written by `libra bench docs` from docs/bench/soak.json...
    <!-- /bench:soak -->

``libra bench docs --run NAME`` runs NAME's command and saves its output; ``libra bench
docs`` rewrites every region from the saved outputs; ``--check`` only compares, and fails
naming the regions that differ (a test runs it, so a figure edited by hand fails ``make
test``). ``make bench-docs`` runs them all.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from libra.config import UsageError

# Relative to where it runs: the repository's root (a developer's command).
README = Path("README.md")
SAVED = Path("docs") / "bench"


@dataclass(frozen=True)
class DocTable:
    """One README region: the command that measures it and how its output reads."""

    name: str
    command: tuple[str, ...]  # after ``libra``
    render: Callable[[Any], list[str]]  # the command's JSON output -> markdown lines

    @property
    def saved(self) -> Path:
        return SAVED / f"{self.name}.json"


def _rows(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    align = ["---" if i == 0 else "---:" for i in range(len(header))]
    return [_line(header), _line(align), *(_line(row) for row in rows)]


def _line(cells: Sequence[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _soak(output: dict[str, Any]) -> list[str]:
    marks = ", ".join(str(mb) for mb in output.get("rss_mb_at_each_tenth", []))
    lines = ["```json", json.dumps(output), "```"]
    return [*lines, "", f"RSS at each tenth of the trajectories (MB): {marks}."] if marks else lines


def _alloc(output: dict[str, Any]) -> list[str]:
    results = output["results"]
    libra = next(r for r in results if r["config"] == "libra")
    rows = [
        [
            r["config"],
            f"{r['step_time_s']:.1f}",
            f"{r['throughput_tok_s']:,.0f}",
            f"{r['idle_frac']:.2f}",
            f"{libra['throughput_tok_s'] / r['throughput_tok_s']:.2f}",
        ]
        for r in results
    ]
    vs = output["libra_vs"]
    return [
        *_rows(("config", "step s", "tokens trained/s", "idle", "libra x"), rows),
        "",
        f"libra's throughput over the static split chosen up front: {vs['static_upfront']}x, "
        f"over the best static split in hindsight: {vs['static_best_hindsight']}x, over "
        f"colocated: {vs['colocated']}x, over libra-no-pool: {vs['libra_no_pool']}x; its "
        f"largest calibrated plan error: {output['plan_error_max']:.1%}.",
    ]


def _engine(output: dict[str, Any]) -> list[str]:
    rows = [
        [
            f"{r['concurrency']:,}",
            f"{r['calls_s']:,.0f}",
            f"{r['bare_aiohttp_calls_s']:,.0f}",
            f"{r['calls_s'] / r['bare_aiohttp_calls_s']:.2f}",
            f"{r['cpu_us_per_call']:,.0f}",
            f"{r['bare_aiohttp_cpu_us_per_call']:,.0f}",
            f"{r['cpu_us_per_call'] / r['bare_aiohttp_cpu_us_per_call']:.2f}",
            f"{r['errors']}",
        ]
        for r in output["results"]
    ]
    header = (
        "concurrent trajectories",
        "engine calls/s",
        "bare aiohttp calls/s",
        "ratio",
        "engine CPU µs/call",
        "bare aiohttp CPU µs/call",
        "CPU ratio",
        "errors",
    )
    return _rows(header, rows)


def _serve(output: dict[str, Any]) -> list[str]:
    rows = [
        [
            f"{level['concurrency']:,}",
            f"{level['direct']['requests_s']:,.0f}",
            f"{level['gateway']['requests_s']:,.0f}",
            f"{level['added_p50_ms']:.2f}",
            f"{level['added_p99_ms']:.2f}",
            f"{level['direct']['server_cpu_us']:,.0f}",
            f"{level['gateway']['server_cpu_us']:,.0f}",
        ]
        for level in output["levels"]
    ]
    header = (
        "sessions",
        "direct req/s",
        "gateway req/s",
        "added p50 ms",
        "added p99 ms",
        "server CPU µs/req",
        "gateway CPU µs/req",
    )
    return _rows(header, rows)


TABLES: dict[str, DocTable] = {
    table.name: table
    for table in (
        DocTable("soak", ("bench", "soak", "--json"), _soak),
        DocTable("alloc", ("bench", "alloc", "--json"), _alloc),
        DocTable("engine", ("bench", "engine", "--json"), _engine),
        DocTable("serve", ("bench", "serve", "--json"), _serve),
    )
}


# ------------------------------------------------------------------------ measuring


def run(table: DocTable) -> dict[str, Any]:
    """Run the table's command here and save what it printed, with where it ran."""
    load = os.getloadavg()[0]
    argv = [sys.executable, "-m", "libra", *table.command]
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise BenchDocsError(f"`libra {' '.join(table.command)}` failed:\n{done.stderr[-2000:]}")
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    saved = {
        "command": "libra " + " ".join(table.command),
        "commit": _commit(),
        "cores": os.cpu_count(),
        "load_average": round(load, 1),
        "output": json.loads(lines[-1]),
    }
    table.saved.parent.mkdir(parents=True, exist_ok=True)
    table.saved.write_text(json.dumps(saved, indent=1) + "\n")
    return saved


def _commit() -> str | None:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() or None


class BenchDocsError(UsageError):
    """A benchmark failed, or the README lacks a table's markers."""


# ------------------------------------------------------------------------ writing


def region(table: DocTable, saved: dict[str, Any]) -> str:
    """The README region's text for what ``table``'s command printed."""
    where = f"commit {saved['commit']}, " if saved.get("commit") else ""
    source = (
        f"Written by `libra bench docs` from `docs/bench/{table.name}.json`: `{saved['command']}`"
        f" ({where}{saved['cores']} cores, load average {saved['load_average']})."
    )
    return "\n".join([source, "", *table.render(saved["output"]), ""])


def rewrite(
    text: str, tables: Sequence[DocTable], saved_dir: Path = SAVED
) -> tuple[str, list[str]]:
    """``text`` with every region whose output is saved written anew; and the names of the
    regions that changed."""
    changed = []
    for table in tables:
        path = saved_dir / f"{table.name}.json"
        if not path.exists():
            continue
        name = re.escape(table.name)
        pattern = re.compile(rf"<!-- bench:{name} -->\n(.*?)<!-- /bench:{name} -->", re.DOTALL)
        found = pattern.search(text)
        if found is None:
            raise BenchDocsError(
                f"the README has no region for {table.name!r}: add "
                f"`<!-- bench:{table.name} -->` and `<!-- /bench:{table.name} -->` lines"
            )
        new = region(table, json.loads(path.read_text()))
        if found.group(1) != new:
            changed.append(table.name)
            text = text[: found.start(1)] + new + text[found.end(1) :]
    return text, changed


# ------------------------------------------------------------------------ the command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--run",
        dest="measure",  # `run` is the command's own entry point
        nargs="+",
        metavar="NAME",
        choices=[*TABLES, "all"],
        help=f"measure first ({', '.join(TABLES)}, or all) and save under docs/bench/",
    )
    parser.add_argument(
        "--check", action="store_true", help="write nothing; fail if a region is out of date"
    )


def main_docs(args: argparse.Namespace) -> int:
    if not README.exists():
        raise BenchDocsError("run `libra bench docs` in the repository's root (no README.md here)")
    names = list(TABLES) if args.measure and "all" in args.measure else (args.measure or [])
    for name in names:
        print(f"bench docs: running `libra {' '.join(TABLES[name].command)}`", file=sys.stderr)
        run(TABLES[name])
    text, changed = rewrite(README.read_text(), list(TABLES.values()))
    if args.check:
        if changed:
            print(f"libra: error: README tables out of date: {', '.join(changed)} "
                  "(run `libra bench docs`)", file=sys.stderr)  # fmt: skip
            return 1
        return 0
    README.write_text(text)
    print(f"bench docs: rewrote {', '.join(changed) or 'nothing'}", file=sys.stderr)
    return 0
