"""``[tracking]`` in ``libra train``: two steps trained with every tracker on, each
step's line, histograms, samples, evaluations and checkpoints read back with the
tracker's own reader, and a resume that continues the tracked run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from mlflow import MlflowClient
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from libra.launch import TrainRunConfig, train
from libra.train import iter_metrics
from tests._helpers import BREVITY, wandb_history, wandb_records

pytestmark = pytest.mark.anyio


def config_of(run_dir: Path, model_dir: Path) -> TrainRunConfig:
    return TrainRunConfig.model_validate(
        {
            "rollout": {
                "env": BREVITY,
                "engine": {"concurrency": 8, "sampling": {"max_tokens_per_turn": 48, "seed": 0}},
                "emulator": {"agent": {"think_tokens": [0, 40]}},
            },
            "eval": {"every": 2, "prompts": 2, "samples": 2},
            "tracking": {"backends": ["tensorboard", "wandb", "mlflow"], "samples": 2},
            "model": str(model_dir),
            "steps": 2,
            "prompts_per_step": 2,
            "samples_per_prompt": 3,
            "run_dir": str(run_dir),
            "trainer": {"lr": 1e-3, "cpu_threads": 1, "backend": "gloo"},
        }
    )


async def test_every_tracker_reads_back_the_run_and_its_resume(
    tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = config_of(tmp_path / "run", tiny_model)
    await train(config)
    tracking = config.run_dir / "tracking"
    lines = list(iter_metrics(config.run_dir))

    events = EventAccumulator(str(tracking / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    tags = events.Tags()
    figures = {"reward_mean", "tokens_trained", "train_s", "statuses/completed"}
    assert figures <= set(tags["scalars"])
    assert {"hist/reward", "hist/response_tokens"} <= set(tags["histograms"])
    assert {"samples/text_summary", "config/text_summary"} <= set(tags["tensors"])
    trained = {e.step: e.value for e in events.Scalars("tokens_trained")}
    assert trained == {line["step"]: line["tokens_trained"] for line in lines}
    # Evaluations at the start and at the end (every 2 steps), at the steps they followed.
    assert [e.step for e in events.Scalars("eval/weight_version")] == [0, 2]

    (first_wandb,) = sorted((tracking / "wandb").glob("offline-run-*"))
    rows = [row for row in wandb_history(first_wandb) if "tokens_trained" in row]
    assert [(row["_step"], row["tokens_trained"]) for row in rows] == [
        (line["step"], line["tokens_trained"]) for line in lines
    ]
    kinds = [r.WhichOneof("record_type") for r in wandb_records(first_wandb)]
    assert kinds.count("artifact") >= 2  # the samples' tables and the checkpoints

    saved = json.loads((tracking / "mlflow-run.json").read_text())
    client = MlflowClient(tracking_uri=saved["uri"])
    history = client.get_metric_history(saved["id"], "tokens_trained")
    assert [(m.step, m.value) for m in history] == [
        (line["step"], line["tokens_trained"]) for line in lines
    ]
    assert client.get_metric_history(saved["id"], "eval/brevity/pass_at_1")
    checkpoints = {a.path for a in client.list_artifacts(saved["id"], "checkpoints")}
    assert checkpoints == {"checkpoints/step-1.json", "checkpoints/step-2.json"}

    # The run dies after step 1's line, before its checkpoint: the resume runs step 1 again.
    shutil.rmtree(config.run_dir / "checkpoints" / "step-00000002")
    capsys.readouterr()
    await train(config, resume=True)
    err = capsys.readouterr().err
    again = list(iter_metrics(config.run_dir))

    events = EventAccumulator(str(tracking / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    trained = {e.step: e.value for e in events.Scalars("tokens_trained")}
    assert trained == {line["step"]: line["tokens_trained"] for line in again}  # step 1's anew
    history = client.get_metric_history(saved["id"], "tokens_trained")
    assert [m.step for m in history] == [0, 1]  # the same MLflow run, no step twice
    assert "mlflow: the killed run logged steps from 1 on" in err
    assert "wandb: offline runs cannot be continued" in err
    _, resumed_wandb = sorted((tracking / "wandb").glob("offline-run-*"))
    steps = [row["_step"] for row in wandb_history(resumed_wandb) if "tokens_trained" in row]
    assert steps == [1]
