"""``libra bench docs``: the docs' benchmark tables are what the saved runs say, and
what the code measures today for the quick case."""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from libra.bench import _docs_render as render
from libra.bench import _docs_render_sched as sched_render
from libra.bench._docs import BenchDocsError, Shard, outputs, region, rewrite, run
from libra.bench._docs_lists import SAVED, TABLES, DocTable, Runs

REPO = Path(__file__).resolve().parents[2]


def _committed(table: DocTable) -> str:
    text = (REPO / table.file).read_text()
    name = re.escape(table.name)
    found = re.search(rf"<!-- bench:{name} -->\n(.*?)<!-- /bench:{name} -->", text, re.DOTALL)
    assert found is not None, f"{table.file} has no region {table.name}"
    return found.group(1)


def test_the_docs_tables_match_their_saved_runs() -> None:
    """A figure edited by hand (or a run saved without rewriting) fails here."""
    for file in {table.file for table in TABLES.values()}:
        text = (REPO / file).read_text()
        tables = [table for table in TABLES.values() if table.file == file]
        assert rewrite(text, tables, REPO / SAVED) == (text, [])
    saved = {path.stem for path in (REPO / SAVED).glob("*.json")}
    shown = {runs.name for table in TABLES.values() for runs in table.sources}
    assert saved <= shown, "a saved run that no docs region shows"


def test_the_quick_case_measured_now_reads_as_the_committed_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A change to the code that moves the figures fails here until `libra bench docs --run
    sched-quick` writes them again."""
    table = TABLES["sched-quick"]
    monkeypatch.chdir(REPO)  # the command names its workload file from the root
    saved = run(table.runs, tmp_path)  # a real `libra bench sched`, in a process of its own
    committed = _committed(table)
    assert region(table, saved).split("\n")[1:] == committed.split("\n")[1:]  # all but whence
    assert outputs(saved)[0]["results"][0]["failed"] == 0


def test_several_commands_are_saved_together_and_read_in_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    runs = Runs("tiny-soaks", tuple(("bench", "soak", "--n", n, "--json") for n in ("20", "30")))

    def counts(soaks: list[dict[str, int]]) -> list[str]:
        return [f"{soak['trajectories']} trajectories, {soak['lost']} lost" for soak in soaks]

    table = DocTable("tiny-soaks", runs, counts)
    saved = run(runs)  # two real soaks, each in a process of its own
    assert [r["command"] for r in saved["runs"]] == [
        "libra bench soak --n 20 --json",
        "libra bench soak --n 30 --json",
    ]
    assert json.loads(runs.saved.read_text()) == saved
    readme = "intro\n<!-- bench:tiny-soaks -->\nold figures\n<!-- /bench:tiny-soaks -->\nafter\n"
    text, changed = rewrite(readme, [table], SAVED)
    assert changed == ["tiny-soaks"]
    assert "2 runs of `libra bench soak` (listed there" in text
    assert text.endswith(
        "20 trajectories, 0 lost\n30 trajectories, 0 lost\n<!-- /bench:tiny-soaks -->\nafter\n"
    )
    assert rewrite(text, [table], SAVED) == (text, [])
    other = DocTable("tiny-soaks", Runs("tiny-soaks", runs.commands[:1]), counts)
    with pytest.raises(BenchDocsError, match="--run tiny-soaks"):
        rewrite(readme, [other], SAVED)  # the saved file holds other commands


def test_a_long_list_is_measured_in_shards_and_resumed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    sizes = ("20", "30", "40")
    runs = Runs("soaks", tuple(("bench", "soak", "--n", n, "--json") for n in sizes))
    table = DocTable("soaks", runs, lambda soaks: [str(s["trajectories"]) for s in soaks])
    page = "<!-- bench:soaks -->\nold\n<!-- /bench:soaks -->\n"
    first = run(runs, shard=Shard.parse("1/2"))  # the 1st and 3rd commands
    assert [r["command"].split()[-2] for r in first["runs"]] == ["20", "40"]
    assert rewrite(page, [table], SAVED) == (page, [])  # partly measured: left as it is
    done = run(runs, resume=True)  # only the 2nd runs; the others are kept as saved
    assert [r["command"].split()[-2] for r in done["runs"]] == ["20", "30", "40"]
    assert done["runs"][::2] == first["runs"]
    text, changed = rewrite(page, [table], SAVED)
    assert changed == ["soaks"] and text.endswith("\n20\n30\n40\n<!-- /bench:soaks -->\n")
    with pytest.raises(argparse.ArgumentTypeError, match="I/N"):
        Shard.parse("3/2")


def test_shards_run_at_once_save_every_run_to_one_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    runs = Runs("soaks", tuple(("bench", "soak", "--n", n, "--json") for n in ("20", "30", "40")))
    with ThreadPoolExecutor(2) as pool:  # each part saves while the other measures
        list(pool.map(lambda part: run(runs, shard=Shard.parse(part)), ("1/2", "2/2")))
    saved = json.loads(runs.saved.read_text())
    assert [r["command"].split()[-2] for r in saved["runs"]] == ["20", "30", "40"]


def test_a_table_reads_several_saved_files_in_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    first, second = Runs("one", (("bench", "a"),)), Runs("two", (("bench", "b"),))
    SAVED.mkdir(parents=True)
    for runs, value in ((first, 1), (second, 2)):
        record = {"command": f"libra {' '.join(runs.commands[0])}", "cores": 2, "commit": "c0"}
        runs.saved.write_text(json.dumps(record | {"load_average": 0.5, "output": value}))
    table = DocTable("both", first, lambda values: [repr(values)], also=(second,))
    text, changed = rewrite("<!-- bench:both -->\n<!-- /bench:both -->\n", [table], SAVED)
    assert changed == ["both"]
    assert "from `docs/bench/one.json`, `docs/bench/two.json`: 2 runs of `libra bench a`" in text
    assert "\n[1, 2]\n" in text
    second.saved.unlink()  # a region whose runs are not all saved is left as it is
    assert rewrite("<!-- bench:both -->\nold\n<!-- /bench:both -->\n", [table], SAVED)[1] == []


def _sched_output(workload: str, seed: int, **spans: float) -> dict[str, Any]:
    results = [{"policy": policy.replace("_", "-"), "makespan_s": s} for policy, s in spans.items()]
    return {"workload": workload, "mismatch": "datasheet", "seed": seed, "results": results}


def test_the_robustness_table_weighs_each_policy_against_the_best_of_the_others() -> None:
    spans = {"round_robin": 300.0, "least_loaded": 200.0, "least_loaded_capacity": 190.0}
    spans |= {"length_pred": 250.0, "cmlfq_fit": 100.0, "oracle": 80.0}
    outputs = [
        # Seed 0: cmlfq 1% behind sorted. Seed 1: 5% behind plas, in a run saved again
        # later (where it is 1% ahead): the later run counts, not both.
        _sched_output("w", 0, sorted=100.0, plas=110.0, cmlfq=101.0, **spans),
        _sched_output("w", 1, sorted=110.0, plas=100.0, cmlfq=105.0, **spans),
        _sched_output("w", 1, sorted=110.0, plas=100.0, cmlfq=99.0, **spans),
    ]
    lines = sched_render.robustness(outputs)
    assert lines[0].startswith("The 2 runs under `datasheet` (w; seeds 0-1)")
    cells = [[cell.strip(" *") for cell in line.strip("|").split("|")] for line in lines[4:13]]
    rows = {row[0]: row[1:] for row in cells}
    assert rows["cmlfq"] == ["1", "2", "1.000", "1.010"]  # 101/100 and 99/100
    assert rows["sorted"] == ["1", "1", "1.051", "1.111"]  # 100/101 and 110/99
    assert rows["oracle"][:2] == ["2", "2"]  # against the baselines, not cmlfq
    assert lines[-1] == (
        "`cmlfq` is fastest or within 2% of the fastest baseline on 2 of 2 runs, worst 1.010; "
        "by the same measure the strongest baseline, `sorted`, on 1 of 2, worst 1.111."
    )


def test_the_goals_say_where_cmlfq_stands_and_its_largest_gap_to_the_oracle() -> None:
    spans = {"round_robin": 300.0, "least_loaded": 200.0, "least_loaded_capacity": 190.0}
    spans |= {"length_pred": 250.0, "cmlfq_fit": 100.0}
    outputs = [
        _sched_output("a", 0, sorted=100.0, plas=110.0, cmlfq=101.0, oracle=90.0, **spans),
        _sched_output("a", 1, sorted=110.0, plas=100.0, cmlfq=109.0, oracle=80.0, **spans),
        _sched_output("b", 0, sorted=100.0, plas=120.0, cmlfq=97.0, oracle=95.0, **spans),
    ]
    lines = sched_render.goals(outputs)
    assert lines[0].startswith("3 runs (a, b): `cmlfq` over the best of the other policies, "
                               "median 1.010, worst 1.090, within 2% on 2 runs")  # fmt: skip
    met = {row.split("|")[1].strip(): row.split("|")[2].strip() for row in lines[4:8]}
    assert met == {
        "the most runs within 2% of the best": "yes",  # sorted: 1, plas: 1
        "the smallest worst case": "yes",  # sorted 1.1, plas 1.2
        "worst at most 1.08": "**no**",
        "median at most 0.99": "**no**",
    }
    assert lines[-1] == "`cmlfq` over the oracle: median 1.122, largest 1.363 (a, seed 1). "
    guessed = {"guess_ratio_median": 0.62, "guess_off_2x": 0.31, "tool_s_unseen": 48.4}
    next(r for r in outputs[1]["results"] if r["policy"] == "cmlfq").update(guessed)
    assert sched_render.goals(outputs)[-1].endswith(
        "There `cmlfq`'s guess of a trajectory's remaining output was a median 0.62x the "
        "truth at its calls, off by more than 2x on 31% of them, and it did not see a mean "
        "48 s of tool time still to come, which the oracle knows."
    )
    guessed["tool_s_unseen"] = 0.4
    next(r for r in outputs[1]["results"] if r["policy"] == "cmlfq").update(guessed)
    assert sched_render.goals(outputs)[-1].endswith(
        "off by more than 2x on 31% of them, while the tool time still to come, which the "
        "oracle also knows, was under a second."
    )


def _alloc_output(seed: int, static: tuple[float, float], bound: float, error: float) -> Any:
    results = [
        {"config": "static-2:2", "throughput_tok_s": 100.0},
        {"config": "static-1:3", "throughput_tok_s": 100.0 * static[0] / static[1]},
    ]
    return {
        "workload": "w",
        "seed": seed,
        "results": results,
        "libra_vs": {
            "static_upfront": static[0],
            "static_best_hindsight": min(static),
            "libra_no_pool": 1.03,
        },
        "bound_vs_static_upfront": bound,
        "plan_error_max": error,
        "step_swing_max": 0.2,
        "pool": {"libra": {"borrows": 8, "releases": 5}},
        "upfront_rollout_over_train": [0.8, 1.1, 1.4],
    }


def test_the_alloc_seeds_say_where_libra_stands_on_each_goal() -> None:
    outputs = [
        _alloc_output(0, (1.3, 1.3), 1.95, 0.10),  # 67% of the bound
        _alloc_output(1, (1.3, 1.25), 2.1, 0.16),  # 62%; static-1:3 the best static
    ]
    lines = render.alloc_seeds(outputs)
    first = [cell.strip() for cell in lines[2].strip("|").split("|")]
    assert first == ["w", "0", "1.300", "1.300 (static-2:2)", "67%", "10.0%", "20.0%", "1.030",
                     "8 / 5", "0.80 to 1.40"]  # fmt: skip
    assert "1.250 (static-1:3)" in lines[3] and "| 62% |" in lines[3]
    met = {row.split("|")[1].strip(): row.split("|")[2].strip() for row in lines[-3:]}
    assert met == {
        "largest calibrated plan error at most 15%": "**no**",
        "ahead of the best static split in hindsight": "yes",
        "at least 66% of the bound": "**no**",
    }


def test_a_saved_run_without_its_region_says_which_markers_to_add(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    SAVED.mkdir(parents=True)
    (SAVED / "soak.json").write_text(json.dumps({"command": "c", "cores": 2, "output": {}}))
    with pytest.raises(BenchDocsError, match="<!-- bench:soak -->"):
        rewrite("no markers here\n", [TABLES["soak"]], SAVED)


def test_check_fails_naming_a_region_out_of_date(tmp_path: Path) -> None:
    shutil.copytree(REPO / "docs", tmp_path / "docs")
    engine = tmp_path / TABLES["engine"].file
    engine.write_text(
        engine.read_text().replace("\n<!-- /bench:engine -->", "\nstale\n<!-- /bench:engine -->")
    )
    done = subprocess.run(
        [sys.executable, "-m", "libra", "bench", "docs", "--check"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 1
    assert "docs tables out of date: engine " in done.stderr
