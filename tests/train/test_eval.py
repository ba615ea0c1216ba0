"""Evaluation during training: pass@k, the eval line, and evaluations beside the steps."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from libra.config import UsageError
from libra.envs import Env, Task
from libra.launch import TrainRunConfig, evaluate, train
from libra.train import EvalConfig, pass_at_k
from libra.train._eval import eval_line
from libra.trainer import read_best
from tests._helpers import BREVITY, scripted_record

pytestmark = pytest.mark.anyio


def test_pass_at_k_is_the_unbiased_estimator() -> None:
    assert pass_at_k(4, 1, 1) == 0.25
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # 1 - C(3,2) / C(4,2)
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 1, 4) == 1.0
    assert pass_at_k(2, 1, 4) == 1.0  # k capped at the samples there are


def test_the_eval_line_counts_faults_apart_from_failed_attempts() -> None:
    records = [
        scripted_record("a0", 1.0, [0, 1], group="a"),
        scripted_record("a1", 0.0, [0, 1, 1], group="a"),
        scripted_record("b0", 0.0, [0, 1], group="b"),
        scripted_record("b1", None, [0, 1], group="b", status="failed"),  # a fault
    ]
    line = eval_line(3, 2, records, EvalConfig(every=1, samples=2))
    figures = line["envs"]["test"]
    assert (line["step"], line["weight_version"]) == (3, 2)
    assert figures["tasks"] == 2 and figures["trajectories"] == 4
    assert figures["statuses"] == {"completed": 3, "failed": 1}
    # a: 1 of 2 pass (pass@1 0.5, pass@2 1); b: 0 of its 1 scored sample.
    assert figures["pass@1"] == pytest.approx((0.5 + 0.0) / 2)
    assert figures["pass@2"] == pytest.approx((1.0 + 0.0) / 2)
    assert figures["reward_mean"] == pytest.approx(1 / 3)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


async def test_each_evaluation_writes_its_line_and_records_and_never_trains(
    tiny_model: Path, tmp_path: Path
) -> None:
    config = TrainRunConfig.model_validate(
        {
            "rollout": {
                "env": BREVITY,
                "engine": {"concurrency": 8, "sampling": {"max_tokens_per_turn": 48}},
                "emulator": {"agent": {"think_tokens": [0, 40]}},
            },
            "eval": {
                "every": 2,
                "prompts": 3,
                "samples": 2,
                "temperature": 0.5,
                "pass_reward": 0.5,
            },
            "model": str(tiny_model),
            "steps": 3,
            "prompts_per_step": 2,
            "samples_per_prompt": 3,
            "mode": "one-step-off",
            "run_dir": str(tmp_path / "run"),
            "trainer": {"lr": 1e-3, "cpu_threads": 1, "backend": "gloo"},
        }
    )
    await train(config)

    run = config.run_dir
    lines = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]
    # At the start, every 2 steps, and at the end: the weights each one evaluated.
    assert [(line["step"], line["weight_version"]) for line in lines] == [(0, 0), (2, 2), (3, 3)]
    for line in lines:
        figures = line["envs"]["brevity"]
        assert figures["tasks"] == 3 and figures["trajectories"] == 6
        assert 0 <= figures["pass@1"] <= figures["pass@2"] <= 1
        records = read_jsonl(run / "eval" / f"step-{line['step']}.jsonl")
        assert len(records) == 6 and {r["sampling"]["temperature"] for r in records} == {0.5}
        assert all("/eval-" in r["task_id"] for r in records)
    # The same held-apart tasks each time, and none of them in training's records.
    first = {r["task_id"] for r in read_jsonl(run / "eval" / "step-0.jsonl")}
    trained = {
        r["task_id"]
        for step in range(3)
        for r in read_jsonl(run / "rollouts" / f"step-{step}.jsonl")
    }
    assert len(first) == 3 and not first & trained


#: What each evaluation's samples score, in order: the start, after steps 1, 2 and 3,
#: then ``libra eval`` of the best checkpoint.
SCRIPT = [0.2, 0.9, 0.4, 0.6, 0.7]
PER_EVALUATION = 2  # eval.prompts x eval.samples


class Scripted(Env):
    """Scores evaluation samples by ``SCRIPT`` (evaluations run one after another) and
    training samples as Brevity does."""

    evaluated = 0  # evaluation trajectories started so far

    def reset(self, task: Task) -> str:
        self.score: float | None = None
        if task.id.key.startswith("eval-"):
            self.score = SCRIPT[Scripted.evaluated // PER_EVALUATION]
            Scripted.evaluated += 1
        return f"Say something short about {task.seed % 100}."

    def reward(self, answer: str) -> float:
        return self.score if self.score is not None else 1.0 / (1.0 + len(answer) / 100.0)


async def test_keep_best_keeps_the_checkpoint_whose_evaluation_scored_highest(
    tiny_model: Path, tmp_path: Path
) -> None:
    Scripted.evaluated = 0
    config = TrainRunConfig.model_validate(
        {
            "rollout": {
                "env": "tests.train.test_eval:Scripted",
                "engine": {"sampling": {"max_tokens_per_turn": 32}},
                "emulator": {"agent": {"think_tokens": [0, 30]}},
            },
            "eval": {"every": 1, "prompts": 2, "samples": 1},
            "keep_best": "eval/scripted/reward_mean",
            "keep_last": 1,
            "model": str(tiny_model),
            "steps": 3,
            "prompts_per_step": 2,
            "samples_per_prompt": 2,
            "run_dir": str(tmp_path / "run"),
            "trainer": {"lr": 1e-3, "cpu_threads": 1, "backend": "gloo"},
        }
    )
    await train(config)

    lines = read_jsonl(config.run_dir / "eval.jsonl")
    assert [line["envs"]["scripted"]["reward_mean"] for line in lines] == SCRIPT[:4]
    # The start has no checkpoint; of steps 1-3, step 1 scored highest: kept beside
    # the newest (keep_last = 1), and step 2 pruned.
    assert read_best(config.run_dir) == {
        "step": 1,
        "metric": "eval/scripted/reward_mean",
        "value": 0.9,
    }
    kept = sorted(p.name for p in (config.run_dir / "checkpoints").iterdir() if p.is_dir())
    assert kept == ["step-00000001", "step-00000003"]

    # libra eval: the kept checkpoint alone, its weights served again; the run unchanged.
    line = await evaluate(config, 1)
    assert (line["step"], line["weight_version"]) == (1, 1)
    assert line["envs"]["scripted"]["reward_mean"] == SCRIPT[4]
    assert read_jsonl(config.run_dir / "eval" / "checkpoints.jsonl") == [line]
    assert len(read_jsonl(config.run_dir / "eval" / "checkpoint-1.jsonl")) == PER_EVALUATION
    assert read_jsonl(config.run_dir / "eval.jsonl") == lines
    with pytest.raises(UsageError, match="no checkpoint after step 2"):
        await evaluate(config, 2)


def test_keep_best_needs_an_evaluation_at_each_checkpoint_it_may_keep() -> None:
    base = {"rollout": {"env": BREVITY}, "keep_best": "eval/brevity/pass@1"}
    with pytest.raises(ValueError, match="multiple of checkpoint_every"):
        TrainRunConfig.model_validate(base)
    with pytest.raises(ValueError, match="multiple of checkpoint_every"):
        TrainRunConfig.model_validate(base | {"eval": {"every": 3}, "checkpoint_every": 2})
    with pytest.raises(ValueError, match="keep_best"):
        TrainRunConfig.model_validate(base | {"keep_best": "pass@1", "eval": {"every": 1}})
