"""The trackers: what each backend logs, read back with the tracker's own reader
(TensorBoard's event reader, the W&B offline run's records, the MLflow client on its
store); a resume that continues the tracked run with no step twice; a backend that is
not installed named with its extra."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from mlflow import MlflowClient
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from libra.config import UsageError
from libra.tracking import RunStart, Sample, StepLog, Trackers, TrackingConfig, scalars
from tests._helpers import wandb_history, wandb_records

ALL = TrackingConfig(backends=["tensorboard", "wandb", "mlflow"], tags=["demo"], samples=2)


def start(folder: Path, resume_step: int | None = None) -> RunStart:
    return RunStart(
        name="arith",
        project="libra-tests",
        group="arith-group",
        tags=["demo"],
        config={"steps": 4, "grpo": {"max_staleness": 1}},
        config_toml="steps = 4\n\n[grpo]\nmax_staleness = 1\n",
        dir=folder,
        resume_step=resume_step,
    )


def entry(step: int, reward: float) -> StepLog:
    sample = Sample(f"t{step}", "python_arith", "ok", reward, 2, 40, "user: 2+2?\n\nassistant: 4")
    return StepLog(
        step,
        {"reward_mean": reward, "weight_version": float(step + 1), "statuses/ok": 4.0},
        {"hist/reward": [0.0, reward, 1.0]},
        [sample],
    )


def tensorboard_scalars(folder: Path, tag: str) -> dict[int, float]:
    events = EventAccumulator(str(folder / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    return {event.step: event.value for event in events.Scalars(tag)}


def wandb_folders(folder: Path) -> list[Path]:
    return sorted((folder / "wandb").glob("offline-run-*"))


def mlflow_run(folder: Path) -> tuple[MlflowClient, str]:
    saved = json.loads((folder / "mlflow-run.json").read_text())
    return MlflowClient(tracking_uri=saved["uri"]), saved["id"]


def test_each_backend_logs_what_its_own_reader_reads_back(tmp_path: Path) -> None:
    checkpoint = tmp_path / "checkpoints" / "step-00000003"
    checkpoint.mkdir(parents=True)
    (checkpoint / "state.json").write_text("{}")
    with Trackers(ALL, start(tmp_path)) as trackers:
        for step, reward in enumerate([0.25, 0.5, 0.75]):
            trackers.log(entry(step, reward))
        trackers.log(StepLog(3, {"eval/weight_version": 3.0, "eval/arith/pass@1": 0.5}))
        trackers.log_checkpoint(3, checkpoint)

    assert tensorboard_scalars(tmp_path, "reward_mean") == {0: 0.25, 1: 0.5, 2: 0.75}
    assert tensorboard_scalars(tmp_path, "eval/arith/pass@1") == {3: 0.5}
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    assert "hist/reward" in events.Tags()["histograms"]
    texts = {
        e.step: e.tensor_proto.string_val[0].decode()
        for e in events.Tensors("samples/text_summary")
    }
    assert "user: 2+2?" in texts[2] and "reward 0.75" in texts[2]

    (run_folder,) = wandb_folders(tmp_path)
    rows = wandb_history(run_folder)
    assert [(row["_step"], row.get("reward_mean")) for row in rows[:3]] == [
        (0, 0.25),
        (1, 0.5),
        (2, 0.75),
    ]
    assert rows[0]["hist/reward/_type"] == "histogram"
    assert rows[0]["samples/_type"] == "table-file" and rows[0]["samples/nrows"] == 1
    assert rows[3]["eval/arith/pass@1"] == 0.5
    records = {r.WhichOneof("record_type"): r for r in wandb_records(run_folder)}
    run = records["run"].run
    assert (run.display_name, run.run_group, list(run.tags)) == ("arith", "arith-group", ["demo"])
    assert {item.key for item in run.config.update} >= {"steps", "grpo"}
    assert records["artifact"].artifact.type == "checkpoint"

    client, run_id = mlflow_run(tmp_path)
    history = client.get_metric_history(run_id, "reward_mean")
    assert [(m.step, m.value) for m in history] == [(0, 0.25), (1, 0.5), (2, 0.75)]
    mlflow = client.get_run(run_id)
    assert mlflow.data.params["grpo.max_staleness"] == "1"
    assert mlflow.info.run_name == "arith" and mlflow.data.tags["libra.group"] == "arith-group"
    artifacts = {a.path for a in client.list_artifacts(run_id)}
    assert {"config.toml", "samples", "checkpoints"} <= artifacts
    pointer = client.download_artifacts(run_id, "checkpoints/step-3.json", str(tmp_path / "dl"))
    assert json.loads(Path(pointer).read_text())["step"] == 3


def test_a_resume_continues_the_tracked_run_with_no_step_twice(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The killed run wrote the lines of steps 0-2; its newest checkpoint is after 2 steps,
    # so the resume runs step 2 again (with another reward) and then step 3.
    with Trackers(ALL, start(tmp_path)) as trackers:
        for step, reward in enumerate([0.25, 0.5, 0.75]):
            trackers.log(entry(step, reward))
    with Trackers(ALL, start(tmp_path, resume_step=2)) as trackers:
        for step, reward in ((2, 0.6), (3, 0.9)):
            trackers.log(entry(step, reward))
    err = capsys.readouterr().err

    # TensorBoard drops what the killed run logged from step 2 on.
    expected = {0: 0.25, 1: 0.5, 2: 0.6, 3: 0.9}
    assert tensorboard_scalars(tmp_path, "reward_mean") == pytest.approx(expected)
    # MLflow continues the same run; step 2 keeps the killed run's figure, said once.
    client, run_id = mlflow_run(tmp_path)
    history = client.get_metric_history(run_id, "reward_mean")
    assert [(m.step, m.value) for m in history] == [(0, 0.25), (1, 0.5), (2, 0.75), (3, 0.9)]
    assert "mlflow: the killed run logged steps from 2 on" in err
    assert len(client.search_runs([client.get_run(run_id).info.experiment_id])) == 1
    # W&B offline: a new run under the same name and group, from step 2, said in one line.
    first, second = wandb_folders(tmp_path)
    assert [row["_step"] for row in wandb_history(first)] == [0, 1, 2]
    assert [row["_step"] for row in wandb_history(second)] == [2, 3]
    run = next(r.run for r in wandb_records(second) if r.WhichOneof("record_type") == "run")
    assert (run.display_name, run.run_group) == ("arith", "arith-group")
    assert "wandb: offline runs cannot be continued" in err


def test_a_backend_not_installed_is_one_line_naming_its_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if never installed
    with pytest.raises(UsageError, match=r"pip install 'libra\[wandb\]'"):
        Trackers(ALL, start(tmp_path))


def test_a_line_becomes_its_numbers_by_path() -> None:
    line = {
        "step": 3,
        "reward_mean": None,
        "statuses": {"ok": 4, "truncated": 1},
        "loss": {"pg": -0.5},
        "alloc": {"decision": "hold", "train_workers": 2, "moved": True},
        "envs": {"quiz": {"reward_mean": 0.5}},
    }
    assert scalars(line) == {
        "step": 3.0,
        "statuses/ok": 4.0,
        "statuses/truncated": 1.0,
        "loss/pg": -0.5,
        "alloc/train_workers": 2.0,
        "alloc/moved": 1.0,
        "envs/quiz/reward_mean": 0.5,
    }
