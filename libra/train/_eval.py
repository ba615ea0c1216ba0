"""Evaluation during training: held-apart tasks on the current weights, never trained.

``[eval]`` with ``every = N`` evaluates the weights the run starts from (after step 0's
count of steps: ``step`` 0), those after every N-th step, and the last ones. Each
evaluation plays its envs' tasks (a task file's, or ``prompts`` seeded tasks per env
drawn apart from training's) ``samples`` times each, through the run's own engine and
scheduler, with its own sampling (greedy by default), and writes:

- one line of ``eval.jsonl``: ``step`` (steps trained), ``weight_version``, and per env
  the tasks, trajectories, statuses, reward mean, response tokens, ``pass@1`` and
  ``pass@k`` (k = ``samples``; a sample passes at ``pass_reward`` or more);
- its records to ``eval/step-K.jsonl``.

It runs beside the next step's rollout and training; the loop waits for it only before
it syncs newer weights, so every call of an evaluation sees one version. A fault is not
a failed attempt: failed trajectories leave ``pass@k``'s samples (``statuses`` counts
them). pass@k is the unbiased estimator over a task's ``n`` scored samples with ``c``
passing, ``1 - C(n - c, k) / C(n, k)``, averaged over tasks.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
from pydantic import Field, NonNegativeFloat, NonNegativeInt, PositiveInt

from libra.config import Section
from libra.engine import Engine, SamplingConfig, TrajectoryJob, TrajectoryRecord, rollout
from libra.envs import Env, Task
from libra.train._metrics import outcomes

EVAL_FILE = "eval.jsonl"


class EvalEnv(Section):
    """One env of an evaluation."""

    env: str = Field(description="a registered name (see libra envs) or module:Class")
    tasks: Path | None = Field(
        None, description="its JSONL task file (default: eval.prompts seeded tasks)"
    )


class EvalConfig(Section):
    """``[eval]``: evaluation during training (off unless ``every`` is set)."""

    every: NonNegativeInt = Field(
        0, description="evaluate every N steps, at the start and at the end; 0: never"
    )
    envs: list[EvalEnv] | None = Field(
        None, description="the envs to evaluate; None: the run's, on seeded tasks"
    )
    prompts: PositiveInt = Field(8, description="seeded tasks per env (a task file: all)")
    samples: PositiveInt = Field(1, description="samples per task: pass@k up to this k")
    temperature: NonNegativeFloat = Field(0.0, description="sampling temperature (0: greedy)")
    max_tokens_per_turn: PositiveInt | None = Field(
        None, description="tokens a turn may sample; None: the rollout's"
    )
    pass_reward: float = Field(1.0, description="a sample passes with this reward or more")
    seed: int = Field(
        20_261_204, description="draws the seeded tasks (apart from training's seeds)"
    )


@dataclass(frozen=True)
class EvalSuite:
    """One env's evaluation tasks."""

    name: str
    env_cls: type[Env]
    tasks: list[Task]


@dataclass
class Evaluation:
    """Evaluates the run's weights on ``suites`` (see the module)."""

    config: EvalConfig
    suites: list[EvalSuite]
    engine: Engine
    run_dir: Path
    sampling: SamplingConfig
    lines_file: str = EVAL_FILE  # under run_dir: where each evaluation's line goes
    records_prefix: str = "step-"  # eval/<prefix><steps done>.jsonl: its records

    def due(self, steps_done: int, steps: int) -> bool:
        every = self.config.every
        return every > 0 and (steps_done % every == 0 or steps_done == steps)

    def forget_after(self, steps_done: int) -> None:
        """A resume at ``steps_done``: the lines of evaluations from then on go (they
        are run again)."""
        path = self.run_dir / self.lines_file
        if path.exists():
            kept = [line for line in path.read_text().splitlines() if _step(line) < steps_done]
            path.write_text("".join(line + "\n" for line in kept))

    async def run(self, steps_done: int, version: int) -> dict[str, Any]:
        """Evaluate the weights served after ``steps_done`` steps (``version``); the
        line written to ``eval.jsonl``."""
        jobs = [
            TrajectoryJob(suite.env_cls, task, sample, steps_done, self.sampling)
            for suite in self.suites
            for task in suite.tasks
            for sample in range(self.config.samples)
        ]
        folder = self.run_dir / "eval"
        folder.mkdir(exist_ok=True)
        records: list[TrajectoryRecord] = []
        with (folder / f"{self.records_prefix}{steps_done}.jsonl").open("wb") as out:
            encoder = msgspec.json.Encoder()

            def keep(record: TrajectoryRecord) -> None:
                records.append(record)
                out.write(encoder.encode(record) + b"\n")

            await rollout(jobs, self.engine, on_record=keep)
        line = eval_line(steps_done, version, records, self.config)
        with (self.run_dir / self.lines_file).open("a") as lines:
            lines.write(json.dumps(line) + "\n")
        print(_summary(line), file=sys.stderr, flush=True)
        return line


def eval_line(
    steps_done: int, version: int, records: list[TrajectoryRecord], config: EvalConfig
) -> dict[str, Any]:
    """The ``eval.jsonl`` line of an evaluation's ``records``."""
    by_env: defaultdict[str, list[TrajectoryRecord]] = defaultdict(list)
    for record in records:
        by_env[record.env].append(record)
    envs = {env: _env_figures(of_env, config) for env, of_env in sorted(by_env.items())}
    return {"step": steps_done, "weight_version": version, "envs": envs}


def _env_figures(records: list[TrajectoryRecord], config: EvalConfig) -> dict[str, Any]:
    scored = [r for r in records if r.status != "failed" and r.reward is not None]
    by_task: defaultdict[str, list[bool]] = defaultdict(list)
    for record in scored:
        by_task[record.task_id].append((record.reward or 0.0) >= config.pass_reward)
    k = config.samples
    return {
        "tasks": len({r.task_id for r in records}),
        **outcomes(records),  # what a step's line says of its records, the same way
        "pass@1": _mean_pass(by_task, 1),
        f"pass@{k}": _mean_pass(by_task, k),
    }


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of ``n`` samples of which ``c`` pass (``k`` capped at ``n``)."""
    k = min(k, n)
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def _mean_pass(by_task: dict[str, list[bool]], k: int) -> float | None:
    values = [pass_at_k(len(p), sum(p), k) for p in by_task.values() if p]
    return statistics.fmean(values) if values else None


def _step(line: str) -> int:
    return int(json.loads(line)["step"]) if line.strip() else -1


def _summary(line: dict[str, Any]) -> str:
    figures = " · ".join(
        f"{env} "
        + " ".join(
            f"{key} {value:.3f}"
            for key, value in env_line.items()
            if (key.startswith("pass@") or key == "reward_mean") and value is not None
        )
        for env, env_line in line["envs"].items()
    )
    return f"eval after {line['step']} steps (v{line['weight_version']}): {figures}"
