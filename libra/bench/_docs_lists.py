"""The lists ``libra bench docs`` measures (:class:`Runs`: the commands, and the file their
outputs are saved in) and the docs' regions each renders (:class:`DocTable`). The
mechanism that runs them and rewrites the pages is :mod:`libra.bench._docs`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from libra.bench import _docs_render as render
from libra.bench import _docs_render_sched as sched_render

# Relative to where it runs: the repository's root (a developer's command).
DOCS = Path("docs")
SAVED = DOCS / "bench"
# The pages the tables are in.
SCHED_PAGE = DOCS / "benchmarks" / "scheduling.md"
POLICIES_PAGE = DOCS / "scheduling" / "policies.md"

Command = tuple[str, ...]  # after ``libra``


@dataclass(frozen=True)
class Runs:
    """Commands measured together, their outputs saved in one file."""

    name: str
    commands: tuple[Command, ...]

    @property
    def saved(self) -> Path:
        return SAVED / f"{self.name}.json"


@dataclass(frozen=True)
class DocTable:
    """One region of a docs page: the runs it shows and how their outputs read."""

    name: str
    runs: Runs
    render: Callable[[list[Any]], list[str]]  # the commands' outputs, in order -> markdown
    file: Path = DOCS / "benchmarks" / "index.md"  # the page it is in
    also: tuple[Runs, ...] = ()  # more runs it reads, their outputs after ``runs``'s

    @property
    def sources(self) -> tuple[Runs, ...]:
        return (self.runs, *self.also)


def _command(line: str) -> Command:
    return tuple(line.split())


def _sched(workload: str, mismatch: str, seed: int = 0) -> Command:
    return _command(f"bench sched --ablate --workload {workload} --mismatch {mismatch} "
                    f"--seed {seed} --json")  # fmt: skip


#: Seed 0 of every shipped workload under both presets the docs read; then the seeds
#: of swe-agent the docs' means over seeds read.
_SCHED = Runs(
    "sched",
    (
        *(
            _sched(w, m)
            for w in ("swe-agent", "math-code", "search-agent")
            for m in ("none", "datasheet")
        ),
        *(_sched("swe-agent", "datasheet", seed) for seed in range(1, 5)),
    ),
)
#: swe-agent's seeds under ``none``, for what in-server priority does where it acts.
_SCHED_NONE = Runs("sched-none", tuple(_sched("swe-agent", "none", seed) for seed in range(5)))


def _seeds(
    name: str, bench: str, workloads: Sequence[str], seeds: int, *, by_seed: bool = False
) -> Runs:
    """``libra bench BENCH`` on seeds ``0..seeds-1`` of each workload, workload by
    workload (or seed by seed: a list measured in parts is then spread over them)."""
    pairs = (
        [(w, s) for s in range(seeds) for w in workloads]
        if by_seed
        else [(w, s) for w in workloads for s in range(seeds)]
    )
    line = "bench {} --workload {} --seed {} --json"
    return Runs(name, tuple(_command(line.format(bench, w, s)) for w, s in pairs))


#: The restated goal's runs (issue 35): ten seeds of every workload under ``datasheet``.
SEED_WORKLOADS = (
    "swe-agent",
    "math-code",
    "search-agent",
    "web-research",
    "swe-memoryless",
    "search-swe-mix",
)
_SCHED_SEEDS = _seeds("sched-seeds", "sched", SEED_WORKLOADS, 10, by_seed=True)
#: The restated allocation goals' runs (issue 35): seeds 0-4 of the benchmark's
#: workload, and of one whose rollout/training ratio drifts through the run.
ALLOC_WORKLOADS = ("swe-drift", "swe-shift")
_ALLOC_SEEDS = _seeds("alloc-seeds", "alloc", ALLOC_WORKLOADS, 5)
#: What the 66% goal asks of the plan: every layout held for a whole run of the seeds
#: furthest from it, the fastest of them at each step picked in hindsight; then the
#: fastest held, routed by the oracle.
_ALLOC_LAYOUTS = Runs(
    "alloc-layouts",
    (
        *(
            _command(f"bench alloc --workload swe-drift --seed {seed} --layouts all --json")
            for seed in (2, 1)
        ),
        *(
            _command(
                f"bench alloc --workload swe-drift --seed {seed} --layouts 6T/2xTP4+1xTP2 "
                "--layouts-routing oracle --json"
            )
            for seed in (2, 1)
        ),
    ),
)
#: The docs' figure of a scheduling run: drawn by the run whose makespans it shows.
_SCHED_FIGURE = Runs(
    "sched-figure",
    (
        _command(
            "bench sched --workload swe-agent --mismatch none --json "
            "--plot docs/bench-swe-agent.png"
        ),
    ),
)
#: What ``tests/bench/test_docs.py`` runs again: seconds, on an 18-trajectory workload.
_QUICK = Runs(
    "sched-quick",
    (
        _command(
            "bench sched --workload docs/bench/tiny-agent.toml "
            "--policies least-loaded,sorted,cmlfq --json"
        ),
    ),
)
PLAIN = sched_render.PLAIN_COLUMNS  # the seeds tables' columns without the ablations


def _seeds_table(name: str, runs: Runs, workload: str) -> DocTable:
    """A seeds table of ``workload`` under ``datasheet``, from runs without ablations."""
    seeds = partial(sched_render.seeds, workload, "datasheet", columns=PLAIN)
    return DocTable(name, runs, seeds, SCHED_PAGE)


RUNS: dict[str, Runs] = {
    runs.name: runs
    for runs in (
        Runs("soak", (_command("bench soak --json"),)),
        Runs("alloc", (_command("bench alloc --json --plot docs/bench-alloc.png"),)),
        Runs("alloc-ahead", (_command("bench alloc --ahead 1,2,3 --json"),)),
        Runs("engine", (_command("bench engine --json"),)),
        Runs("engine-view", (_command("bench engine --view --pairs 5 --json"),)),
        Runs("serve", (_command("bench serve --json"),)),
        Runs("train", (_command("bench train --json --long 2048 8192"),)),
        _SCHED,
        _SCHED_NONE,
        _SCHED_FIGURE,
        _QUICK,
        _SCHED_SEEDS,
        _ALLOC_SEEDS,
        _ALLOC_LAYOUTS,
    )
}
TABLES: dict[str, DocTable] = {
    table.name: table
    for table in (
        DocTable("soak", RUNS["soak"], render.soak, DOCS / "reliability" / "faults.md"),
        DocTable("alloc", RUNS["alloc"], render.alloc, DOCS / "benchmarks" / "allocation.md"),
        DocTable(
            "alloc-seeds", _ALLOC_SEEDS, render.alloc_seeds, DOCS / "benchmarks" / "allocation.md"
        ),
        DocTable(
            "alloc-layouts",
            _ALLOC_LAYOUTS,
            render.alloc_layouts,
            DOCS / "benchmarks" / "allocation.md",
        ),
        DocTable(
            "alloc-ahead",
            RUNS["alloc-ahead"],
            render.alloc_ahead,
            DOCS / "benchmarks" / "allocation.md",
        ),
        DocTable("engine", RUNS["engine"], render.engine, DOCS / "benchmarks" / "engine.md"),
        DocTable(
            "engine-view",
            RUNS["engine-view"],
            render.engine_view,
            DOCS / "benchmarks" / "engine.md",
        ),
        DocTable("serve", RUNS["serve"], render.serve, DOCS / "benchmarks" / "gateway.md"),
        DocTable("train", RUNS["train"], render.train, DOCS / "benchmarks" / "trainer.md"),
        DocTable(
            "sched-swe-datasheet",
            _SCHED,
            partial(sched_render.one_run, "swe-agent", "datasheet"),
            SCHED_PAGE,
        ),
        DocTable(
            "sched-swe-none",
            _SCHED,
            partial(sched_render.one_run, "swe-agent", "none"),
            SCHED_PAGE,
        ),
        DocTable("sched-workloads", _SCHED, sched_render.workloads, SCHED_PAGE),
        DocTable("sched-ablations", _SCHED, sched_render.ablations, SCHED_PAGE),
        DocTable(
            "sched-seeds", _SCHED, partial(sched_render.seeds, "swe-agent", "datasheet"), SCHED_PAGE
        ),
        DocTable(
            "sched-seeds-none",
            _SCHED_NONE,
            partial(sched_render.seeds, "swe-agent", "none"),
            SCHED_PAGE,
        ),
        DocTable("sched-goals", _SCHED_SEEDS, sched_render.goals, SCHED_PAGE),
        DocTable("sched-robustness", _SCHED_SEEDS, sched_render.robustness, SCHED_PAGE),
        *(_seeds_table(f"sched-ten-seeds-{w}", _SCHED_SEEDS, w) for w in SEED_WORKLOADS),
        DocTable("sched-figure", _SCHED_FIGURE, sched_render.sched_figure, SCHED_PAGE),
        DocTable("sched-quick", _QUICK, sched_render.policies, POLICIES_PAGE),
    )
}


# ------------------------------------------------------------------------ measuring
