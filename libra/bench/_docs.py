"""``libra bench docs``: the docs' benchmark tables, written from saved runs, never by hand.

Each documented benchmark has a fixed list of commands (``libra bench ... --json`` lines:
one, or e.g. every workload under two presets and five seeds), a file under
``docs/bench/`` holding what they printed (each with the commit, the cores and the load
average it ran under), and regions of the docs' pages (``docs/``) between two markers,
each rendered from all of the list's outputs (a region comparing across lists reads
several, in order)::

    <!-- bench:soak -->
    ...written by `libra bench docs` from docs/bench/soak.json...
    <!-- /bench:soak -->

``libra bench docs --run NAME`` runs NAME's commands and saves their outputs; ``libra
bench docs`` rewrites every region from the saved outputs; ``--check`` only compares, and
fails naming the regions that differ (a test runs it, so a figure edited by hand fails
``make test``). ``make bench-docs`` runs them all.

A list that outlasts one sitting (ten seeds of six workloads) is run in parts: the
file is saved after each command, ``--resume`` runs only the commands it lacks, and
``--shard I/N`` only the I-th of N interleaved parts of the list, keeping the runs the
file holds (the shards may run at once: each merges what the others saved). A region
whose runs are not all saved yet is left as it is, and says so.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from libra.bench._docs_lists import RUNS, SAVED, TABLES, Command, DocTable, Runs
from libra.config import UsageError


@dataclass(frozen=True)
class Shard:
    """The ``index``-th (from 1) of ``count`` interleaved parts of a list of commands."""

    index: int
    count: int

    @classmethod
    def parse(cls, text: str) -> Shard:
        index, _, count = text.partition("/")
        if not (index.isdigit() and count.isdigit() and 1 <= int(index) <= int(count)):
            raise argparse.ArgumentTypeError(f"--shard takes I/N with 1 <= I <= N, not {text!r}")
        return cls(int(index), int(count))

    def holds(self, position: int) -> bool:
        return position % self.count == self.index - 1


def run(
    runs: Runs, saved_dir: Path = SAVED, *, resume: bool = False, shard: Shard | None = None
) -> dict[str, Any]:
    """Run each of the commands here, in turn, and save what they printed, with where they
    ran (after each command: a long list keeps what it has measured). ``resume`` keeps
    the saved runs of commands still on the list and runs the others; ``shard`` runs
    only its part of the list (keeping the saved runs of the other parts)."""
    path = saved_dir / f"{runs.name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    keep = resume or shard is not None
    done = _kept(runs, path) if keep else {}
    for position, command in enumerate(runs.commands):
        line = _line(command)
        if (shard is not None and not shard.holds(position)) or (resume and line in done):
            continue
        print(f"bench docs: running `{line}`", file=sys.stderr)
        measured = _measure(command)
        with _locked(path):  # the other shards, run at once, save to the same file
            done = {**_kept(runs, path), **done} if keep else done
            done[line] = measured
            path.write_text(json.dumps(_saved(runs, done), indent=1) + "\n")
    missing = len(runs.commands) - len(done)
    if missing:
        resume_with = f"`libra bench docs --run {runs.name} --resume`"
        print(f"bench docs: {runs.name}: {missing} of {len(runs.commands)} runs still to "
              f"measure ({resume_with})", file=sys.stderr)  # fmt: skip
    return _saved(runs, done)


def _line(command: Command) -> str:
    return "libra " + " ".join(command)


def _lines(runs: Runs) -> list[str]:
    return [_line(command) for command in runs.commands]


def _saved_runs(path: Path) -> dict[str, dict[str, Any]]:
    text = path.read_text() if path.exists() else ""
    return {record["command"]: record for record in records(json.loads(text))} if text else {}


def _kept(runs: Runs, path: Path) -> dict[str, dict[str, Any]]:
    """The saved runs of commands still on the list."""
    lines = set(_lines(runs))
    return {key: record for key, record in _saved_runs(path).items() if key in lines}


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    with path.open("a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        yield


def _saved(runs: Runs, done: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """What the file holds: the runs measured, in the list's order."""
    ordered = [done[line] for line in _lines(runs) if line in done]
    return ordered[0] if len(runs.commands) == 1 and ordered else {"runs": ordered}


def _measure(command: Command) -> dict[str, Any]:
    load = os.getloadavg()[0]
    argv = [sys.executable, "-m", "libra", *command]
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise BenchDocsError(f"`libra {' '.join(command)}` failed:\n{done.stderr[-2000:]}")
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    return {
        "command": _line(command),
        "commit": _commit(),
        "cores": os.cpu_count(),
        "load_average": round(load, 1),
        "output": json.loads(lines[-1]),
    }


def _commit() -> str | None:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() or None


def records(saved: dict[str, Any]) -> list[dict[str, Any]]:
    """The saved runs, in order (one command's run is saved on its own)."""
    found: list[dict[str, Any]] = saved.get("runs", [saved])
    return found


class BenchDocsError(UsageError):
    """A benchmark failed, or a page lacks a table's markers."""


# ------------------------------------------------------------------------ writing


def region(table: DocTable, *saved: dict[str, Any]) -> str:
    """The region's text for what ``table``'s commands printed (``saved``: one file's
    contents for each of its :attr:`~DocTable.sources`, in order)."""
    done: list[dict[str, Any]] = []
    for runs, contents in zip(table.sources, saved, strict=True):
        these = records(contents)
        if [record["command"] for record in these] != _lines(runs):
            raise BenchDocsError(
                f"docs/bench/{runs.name}.json holds other commands than {runs.name!r}"
                f" runs: run `libra bench docs --run {runs.name}`"
            )
        done += these
    rendered = table.render([record["output"] for record in done])
    return "\n".join([_source(table.sources, done), "", *rendered, ""])


def outputs(saved: dict[str, Any]) -> list[Any]:
    return [record["output"] for record in records(saved)]


def _source(sources: Sequence[Runs], done: list[dict[str, Any]]) -> str:
    where = ", ".join(f"`docs/bench/{runs.name}.json`" for runs in sources)
    if len(done) == 1:
        commit = f"commit {done[0]['commit']}, " if done[0].get("commit") else ""
        return (
            f"Written by `libra bench docs` from {where}: `{done[0]['command']}`"
            f" ({commit}{done[0]['cores']} cores, load average {done[0]['load_average']})."
        )
    commits = sorted({str(record.get("commit")) for record in done})
    loads = [record["load_average"] for record in done]
    first = " ".join(done[0]["command"].split()[:3])
    return (
        f"Written by `libra bench docs` from {where}: {len(done)} runs of `{first}` (listed"
        f" there; commit {', '.join(commits)}, {done[0]['cores']} cores, load average "
        f"{min(loads)}-{max(loads)})."
    )


def rewrite(
    text: str, tables: Sequence[DocTable], saved_dir: Path = SAVED
) -> tuple[str, list[str]]:
    """``text`` with the region of each of ``tables`` whose runs are saved written anew; and
    the names of the regions that changed."""
    changed = []
    for table in tables:
        paths = [saved_dir / f"{runs.name}.json" for runs in table.sources]
        if not all(path.exists() for path in paths):
            continue
        saved = [json.loads(path.read_text()) for path in paths]
        if any(
            _partly(runs, contents) for runs, contents in zip(table.sources, saved, strict=True)
        ):
            continue
        name = re.escape(table.name)
        pattern = re.compile(rf"<!-- bench:{name} -->\n(.*?)<!-- /bench:{name} -->", re.DOTALL)
        found = pattern.search(text)
        if found is None:
            raise BenchDocsError(
                f"{table.file} has no region for {table.name!r}: add "
                f"`<!-- bench:{table.name} -->` and `<!-- /bench:{table.name} -->` lines"
            )
        new = region(table, *saved)
        if found.group(1) != new:
            changed.append(table.name)
            text = text[: found.start(1)] + new + text[found.end(1) :]
    return text, changed


def _partly_saved(runs: Runs) -> bool:
    return runs.saved.exists() and _partly(runs, json.loads(runs.saved.read_text()))


def _partly(runs: Runs, contents: dict[str, Any]) -> bool:
    """Whether ``contents`` holds ``runs`` only in part (a sitting of a long list):
    every saved command on the list, in its order, some not saved yet."""
    saved = [record["command"] for record in records(contents)]
    in_order = [line for line in _lines(runs) if line in saved]
    return bool(saved) and saved == in_order and len(saved) < len(runs.commands)


# ------------------------------------------------------------------------ the command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--run",
        dest="measure",  # `run` is the command's own entry point
        nargs="+",
        metavar="NAME",
        choices=[*RUNS, "all"],
        help=f"measure first ({', '.join(RUNS)}, or all) and save under docs/bench/",
    )
    parser.add_argument(
        "--resume", action="store_true", help="with --run: measure only what is not saved yet"
    )
    parser.add_argument(
        "--shard",
        type=Shard.parse,
        metavar="I/N",
        help="with --run: measure only the I-th of N interleaved parts of each list",
    )
    parser.add_argument(
        "--check", action="store_true", help="write nothing; fail if a region is out of date"
    )


def main_docs(args: argparse.Namespace) -> int:
    if not SAVED.is_dir():
        raise BenchDocsError("run `libra bench docs` in the repository's root (no docs/bench here)")
    names = list(RUNS) if args.measure and "all" in args.measure else (args.measure or [])
    for name in names:
        run(RUNS[name], resume=args.resume, shard=args.shard)
    for name in (n for n, runs in RUNS.items() if _partly_saved(runs)):
        print(f"bench docs: {name} is partly measured: its regions are left as they are "
              f"(`libra bench docs --run {name} --resume`)", file=sys.stderr)  # fmt: skip
    rewritten = {}
    for file in dict.fromkeys(table.file for table in TABLES.values()):
        tables = [table for table in TABLES.values() if table.file == file]
        rewritten[file] = rewrite(file.read_text(), tables)
    changed = [name for _, names_changed in rewritten.values() for name in names_changed]
    if args.check:
        if changed:
            print(f"libra: error: docs tables out of date: {', '.join(changed)} "
                  "(run `libra bench docs`)", file=sys.stderr)  # fmt: skip
            return 1
        return 0
    for file, (text, _) in rewritten.items():
        file.write_text(text)
    print(f"bench docs: rewrote {', '.join(changed) or 'nothing'}", file=sys.stderr)
    return 0
