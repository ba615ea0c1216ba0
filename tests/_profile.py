"""``pytest --profile FILE``: where the suite's minutes and memory go, one JSON line a test.

Each line names the test, its tier (the markers of the real parts it starts), its outcome,
its setup, call and teardown seconds, the processes it started (vLLM servers, Python
processes spawned outside vLLM and Ray: trainers and their ranks; Ray instances), and the
peak resident memory of pytest and every process under it while it ran, sampled twice a
second (Docker's containers run under the Docker engine, not under pytest: not counted).
A process started by a session-scoped fixture is counted against the test that started it;
one running before a test began is not the test's. Each pytest run (not an xdist worker:
they take no conftest option) adds a line with its tests and wall time.
``python -m tests._profile FILE`` renders the lines as the table in ``docs/develop.md``.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

import pytest

#: The markers that say which real parts a test starts (``tests/conftest.py`` sets most).
TIERS = ("vllm", "trainer", "ray", "docker", "bwrap", "browser", "slow")
SAMPLE_S = 0.5


@dataclass
class Usage:
    """What one test started and held."""

    vllm: int = 0
    spawned: int = 0
    ray: int = 0
    peak_rss_mib: float = 0.0
    seen: set[int] = field(default_factory=set)


def _kind(cmdline: list[str]) -> str | None:
    line = " ".join(cmdline)
    if "vllm.entrypoints" in line:
        return "vllm"
    if "raylet" in line:
        return "ray"
    if "spawn_main" in line or "multiprocessing-fork" in line:
        return "spawned"
    return None


class Sampler:
    """Polls pytest's process tree while a test runs (a thread: the test may block)."""

    def __init__(self) -> None:
        import psutil  # type: ignore[import-untyped]  # (it comes with vLLM and Ray)

        self._psutil = psutil
        self._me = psutil.Process()
        self.usage = Usage()
        self._inside: set[int] = set()  # processes under a vLLM server or Ray: theirs
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="test-profile", daemon=True)

    def __enter__(self) -> Usage:
        self._sample(count=False)  # what runs already (a session's server) is not its
        self._thread.start()
        return self.usage

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            self._sample()

    def _sample(self, *, count: bool = True) -> None:
        psutil, usage = self._psutil, self.usage
        rss = 0
        try:
            processes = [self._me, *self._me.children(recursive=True)]
        except psutil.Error:
            return
        new = []
        for process in processes:
            try:
                rss += process.memory_info().rss
                if process.pid not in usage.seen and process is not self._me:
                    new.append(process)
            except psutil.Error:
                continue  # it ended between the listing and the look
        usage.peak_rss_mib = max(usage.peak_rss_mib, rss / 2**20)
        kinds: dict[int, str | None] = {}
        for process in new:
            usage.seen.add(process.pid)
            try:
                kinds[process.pid] = _kind(process.cmdline())
            except psutil.Error:
                continue
        servers = self._inside | {pid for pid, kind in kinds.items() if kind in ("vllm", "ray")}
        for process in new:
            try:
                ancestors = {parent.pid for parent in process.parents()}
            except psutil.Error:
                continue
            if ancestors & servers:  # vLLM's own (a guard's server, its workers), Ray's
                self._inside.add(process.pid)
                continue
            kind = kinds.get(process.pid)
            if kind is None:
                continue
            if count:
                setattr(usage, kind, getattr(usage, kind) + 1)
            if kind != "spawned":
                self._inside.add(process.pid)


class Profile:
    """The plugin: one line a test, written as each test ends."""

    def __init__(self, out: IO[str], config: pytest.Config) -> None:
        self.out, self.config = out, config
        self.phases: dict[str, dict[str, Any]] = {}
        self.started = time.monotonic()

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        """The run's own line (not an xdist worker's): its tests and wall seconds."""
        if hasattr(self.config, "workerinput"):
            return
        workers = getattr(self.config.option, "numprocesses", None) or 1
        run = {
            "markers": self.config.option.markexpr,
            "tests": session.testscollected,
            "workers": workers,
            "wall_s": time.monotonic() - self.started,
        }
        self.out.write(json.dumps({"run": run}) + "\n")
        self.out.flush()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: object) -> Any:
        start = time.monotonic()
        try:
            sampler: Sampler | None = Sampler()
        except ModuleNotFoundError:  # psutil comes with vLLM; without it, times alone
            sampler = None
        if sampler is None:
            yield
            usage = Usage()
        else:
            with sampler as usage:
                yield
        line = self.phases.pop(item.nodeid, {})
        tiers = [tier for tier in TIERS if item.get_closest_marker(tier) is not None]
        counts = asdict(usage)
        del counts["seen"]
        line |= {"test": item.nodeid, "tiers": tiers, "wall_s": time.monotonic() - start}
        self.out.write(json.dumps(line | counts) + "\n")
        self.out.flush()

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        line = self.phases.setdefault(report.nodeid, {"outcome": "passed"})
        line[f"{report.when}_s"] = round(report.duration, 3)
        if report.outcome != "passed" and (report.when == "call" or report.failed):
            line["outcome"] = report.outcome


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--profile",
        type=Path,
        metavar="FILE",
        help="append each test's seconds, started processes and peak memory to FILE "
        "(JSON lines; python -m tests._profile FILE renders them; not with -n)",
    )


def pytest_configure(config: pytest.Config) -> None:
    path: Path | None = config.getoption("--profile")
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    out = path.open("a")
    config.add_cleanup(out.close)
    config.pluginmanager.register(Profile(out, config), "libra-profile")


# ------------------------------------------------------------------- the docs' table

#: Where ``docs/develop.md`` holds the table (rewritten by ``--write``, checked by a test).
BEGIN, END = "<!-- suite-profile -->", "<!-- /suite-profile -->"
SAVED = Path(__file__).parent.parent / "docs" / "bench" / "suite-profile.jsonl"
TOP = 15


def read(path: Path) -> tuple[list[dict[str, Any]], str]:
    """The heavy tier's lines (those with a tier), the last run of each test; and a
    label: where it was measured (a saved profile's), and each pytest run's wall time."""
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    label = next((line["label"] for line in lines if "label" in line), "")
    tests = {line["test"]: line for line in lines if line.get("tiers")}
    for run in (line["run"] for line in lines if "run" in line):
        tier = "heavy tier" if run["workers"] == 1 else f"fast tier, {run['workers']} workers"
        label += f"; {tier}: {run['tests']} tests in {run['wall_s'] / 60:.1f} minutes"
    return list(tests.values()), label


def _cells(lines: list[dict[str, Any]]) -> str:
    minutes = sum(line["wall_s"] for line in lines) / 60
    peak = max(line["peak_rss_mib"] for line in lines) / 1024
    vllm, spawned, ray = (sum(line[k] for line in lines) for k in ("vllm", "spawned", "ray"))
    return f"{minutes:.1f} | {vllm} | {spawned} | {ray} | {peak:.1f} |"


def render(lines: list[dict[str, Any]], label: str = "") -> str:
    """Per file, then the slowest tests: minutes, processes started, peak memory."""
    columns = "minutes | vLLM starts | spawned | Ray starts | peak GiB |"
    files: dict[str, list[dict[str, Any]]] = {}
    for line in lines:
        files.setdefault(line["test"].split("::")[0], []).append(line)
    by_time = sorted(files.items(), key=lambda item: -sum(x["wall_s"] for x in item[1]))
    slowest = sorted(lines, key=lambda line: -line["wall_s"])[:TOP]
    total = sum(line["wall_s"] for line in lines) / 60
    return "\n".join(
        [
            f"{label}. The heavy tier's tests, {total:.1f} minutes in all:",
            "",
            f"| file | tests | {columns}",
            "|---|---:|---:|---:|---:|---:|---:|",
            *(f"| `{name}` | {len(group)} | {_cells(group)}" for name, group in by_time),
            f"| **all** | {len(lines)} | {_cells(lines)}",
            "",
            f"The {TOP} slowest tests:",
            "",
            f"| test | {columns}",
            "|---|---:|---:|---:|---:|---:|",
            *(f"| `{line['test'].split('/', 1)[1]}` | {_cells([line])}" for line in slowest),
        ]
    )


def rewrite(page: str, table: str) -> str:
    before, _, rest = page.partition(BEGIN)
    _, _, after = rest.partition(END)
    return f"{before}{BEGIN}\n{table}\n{END}{after}"


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m tests._profile", description=__doc__)
    parser.add_argument("file", type=Path, help="what pytest --profile wrote")
    parser.add_argument(
        "--write", action="store_true", help=f"save it as {SAVED.name}, rewrite docs/develop.md"
    )
    parser.add_argument("--label", default="", help="where and when it was measured")
    args = parser.parse_args(argv)
    lines, label = read(args.file)
    label = args.label + label  # (a fresh profile's label is its runs' times)
    table = render(lines, label)
    if not args.write:
        print(table)
        return 0
    kept = [json.dumps(line) for line in sorted(lines, key=lambda line: line["test"])]
    SAVED.write_text("\n".join([json.dumps({"label": label}), *kept]) + "\n")
    page = SAVED.parent.parent / "develop.md"
    page.write_text(rewrite(page.read_text(), table))
    print(f"wrote {SAVED} and the table in {page}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
