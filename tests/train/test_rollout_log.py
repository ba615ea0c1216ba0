"""The durable trajectory log: appended as records finish, read back past a torn line,
and trimmed on resume to what the checkpoint's weights (or older ones) sampled."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest

from libra.engine import TrajectoryRecord
from libra.engine._records import WeightSpan
from libra.train._rollout_log import (
    RolloutLog,
    keep_reusable,
    logged_steps,
    newest_version,
    read_step,
    step_file,
)
from tests._helpers import record_of


def record(step: int, sample: int, versions: tuple[int, ...] = ()) -> TrajectoryRecord:
    """Sample ``sample`` of one task at ``step``; each of ``versions`` sampled one token."""
    ids = list(range(2 + len(versions)))
    base = record_of(ids, [0, 0] + [1] * len(versions), [None, None] + [-1.0] * len(versions))
    spans = [WeightSpan(2 + i, 3 + i, version) for i, version in enumerate(versions)]
    return msgspec.structs.replace(
        base,
        id=f"calc/t#{sample}@{step}",
        group_id=f"calc/t@{step}",
        step=step,
        sample=sample,
        weight_versions=spans,
        weight_version=versions[0] if versions else None,
    )


def test_records_are_on_disk_as_each_is_appended(tmp_path: Path) -> None:
    with RolloutLog(tmp_path) as log:
        log.append(record(0, 0, (0,)))
        # Read by another process while the writer still holds the file open.
        assert [r.id for r in read_step(tmp_path, 0)] == ["calc/t#0@0"]
        log.append(record(1, 0, (0, 1)))
        log.append(record(0, 1, (0,)))
        log.finish(0)
    assert [r.sample for r in read_step(tmp_path, 0)] == [0, 1]
    assert read_step(tmp_path, 1) == [record(1, 0, (0, 1))]  # every field comes back
    assert logged_steps(tmp_path) == [0, 1]
    assert read_step(tmp_path, 2) == []


def test_a_torn_last_line_is_skipped_and_a_torn_middle_one_is_an_error(tmp_path: Path) -> None:
    with RolloutLog(tmp_path) as log:
        log.append(record(0, 0))
        log.append(record(0, 1))
    path = step_file(tmp_path, 0)
    whole = path.read_bytes()
    path.write_bytes(whole + whole[: len(whole) // 3])  # killed mid-write of a third line
    assert [r.sample for r in read_step(tmp_path, 0)] == [0, 1]
    path.write_bytes(whole[:-10])  # the second line torn: still the last one
    assert [r.sample for r in read_step(tmp_path, 0)] == [0]
    path.write_bytes(whole[:10] + b"\n" + whole)
    with pytest.raises(ValueError, match="line 1 is not a record"):
        read_step(tmp_path, 0)


def test_a_killed_writer_loses_no_record_it_appended(tmp_path: Path) -> None:
    """A process appends records in a loop and is killed with SIGKILL: every line the
    file holds, but a torn last one, is a whole record."""
    script = (
        "import sys\n"
        "from pathlib import Path\n"
        "from tests.train.test_rollout_log import record\n"
        "from libra.train._rollout_log import RolloutLog\n"
        "log = RolloutLog(Path(sys.argv[1])).__enter__()\n"
        "sample = 0\n"
        "while True:\n"
        "    log.append(record(0, sample, (0,) * 200))\n"
        "    sample += 1\n"
    )
    root = str(Path(__file__).parents[2])
    writer = subprocess.Popen(
        [sys.executable, "-c", script, str(tmp_path)], env={**os.environ, "PYTHONPATH": root}
    )
    deadline = time.monotonic() + 60
    while len(read_step(tmp_path, 0)) < 20:
        assert writer.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    writer.kill()
    writer.wait()
    records = read_step(tmp_path, 0)
    assert [r.sample for r in records] == list(range(len(records)))
    assert len(records) >= 20


def test_resume_keeps_what_the_checkpoint_weights_or_older_sampled(tmp_path: Path) -> None:
    with RolloutLog(tmp_path) as log:
        log.append(record(0, 0, (0,)))  # before the checkpoint's step: left alone
        log.append(record(1, 0, (1,)))
        log.append(record(1, 1, (0, 1)))
        log.append(record(1, 2))  # failed before its first call: no weights in it
        log.append(record(2, 0, (1, 2)))  # weights v2 are lost with the killed run
        log.append(record(2, 1, (1,)))  # one-step-off: sampled on v1 before the sync
        log.append(record(3, 0, (2,)))
    before = step_file(tmp_path, 0).stat().st_mtime_ns
    with step_file(tmp_path, 1).open("ab") as out:
        out.write(b'{"id": "torn')

    kept = keep_reusable(tmp_path, first_step=1, version=1)

    assert {step: [r.sample for r in records] for step, records in kept.items()} == {
        1: [0, 1, 2],
        2: [1],
    }
    # The files now hold just those (the torn line is gone); a step with none has none.
    assert read_step(tmp_path, 1) == kept[1] and read_step(tmp_path, 2) == kept[2]
    assert not step_file(tmp_path, 1).read_bytes().endswith(b"torn")
    assert logged_steps(tmp_path) == [0, 1, 2]
    assert step_file(tmp_path, 0).stat().st_mtime_ns == before
    assert not list((tmp_path / "rollouts").glob(".partial-*"))


def test_a_record_s_newest_version_is_over_its_sampled_spans() -> None:
    assert newest_version(record(0, 0, (3, 1, 2))) == 3
    assert newest_version(record(0, 0)) is None
