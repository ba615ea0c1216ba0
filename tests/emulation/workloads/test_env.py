"""A workload's env and the emulated model play the same script; a tool's output has the
scripted size and status."""

from __future__ import annotations

from pathlib import Path

import anyio
from trio.testing import MockClock

from libra.bench._sched_fleet import load_fleet
from libra.bench._sched_history import signal_of
from libra.emulation import EmulatorConfig, create_app
from libra.emulation.workloads import ScriptBook, load_workload
from libra.emulation.workloads._env import EnvClasses, WorkloadScript, prompt_text, tool_output
from libra.engine import (
    Engine,
    EngineConfig,
    SamplingConfig,
    TrajectoryJob,
    TrajectoryRecord,
    rollout,
)
from libra.engine._asgi import ASGITransport
from libra.envs import Task
from libra.fleet import Endpoint
from libra.sched.policies import LeastLoadedScheduler
from libra.signals import size_class


def test_the_env_and_the_emulated_model_play_the_same_script(tiny: Path) -> None:
    workload = load_workload(str(tiny))
    book = ScriptBook(workload, seed=5)
    scripts = book.step(1)
    fleet = load_fleet()
    records: list[TrajectoryRecord] = []

    async def play() -> None:
        config = EmulatorConfig(model_name="m", latency=fleet.latency(2), prefix_caching=True)
        app = create_app(config, WorkloadScript(book))
        endpoint = Endpoint("http://solo", model="m", api="tokens")
        engine_config = EngineConfig(
            max_context_tokens=20000,
            tool_timeout_s=workload.limits.tool_timeout_s,
            sampling=SamplingConfig(max_tokens_per_turn=8000, seed=5),
        )
        classes = EnvClasses(book)
        jobs = [
            TrajectoryJob(classes(1, s.sample), Task(s.task_id, s.task_seed), s.sample, 1)
            for s in scripts
        ]
        async with ASGITransport(app) as http:
            scheduler = LeastLoadedScheduler([endpoint])
            engine = Engine(http, scheduler, config=engine_config)
            await rollout(jobs, engine, on_record=records.append)

    anyio.run(play, backend="trio", backend_options={"clock": MockClock(autojump_threshold=0)})
    by_id = {record.id: record for record in records}
    for script in scripts:
        record = by_id[str(script.trajectory_id)]
        assert record.status == "completed" and record.tokens == "exact"
        assert record.turns == len(script.turns)
        assert sum(record.loss_mask) == script.output_tokens
        scripted = [turn for turn in script.turns if turn.tool is not None]
        assert [r.tool for r in record.tool_returns] == [t.tool for t in scripted]
        for returned, turn in zip(record.tool_returns, scripted, strict=True):
            expected = signal_of(turn, workload.limits.tool_timeout_s)
            assert (returned.status, returned.size_class) == (
                expected.status,
                expected.size_class,
            )
        assert record.reward == (1.0 if script.solved else 0.0)
    assert any(r.status == "timeout" for rec in records for r in rec.tool_returns) or all(
        t.status != "timeout" for s in scripts for t in s.turns
    )


def test_a_failed_check_reads_as_a_failure_of_the_scripted_size() -> None:
    from libra.emulation.workloads import ScriptTurn

    failed = ScriptTurn(500, "run_sql", "failure", 1200, 1.0)
    content = tool_output(failed)
    assert len(content) == 1200 and content.startswith("Traceback (most recent call last)")
    assert size_class(len(content)) == "medium"


def test_the_samples_of_a_task_share_their_prompt_but_its_end(tiny: Path) -> None:
    book = ScriptBook(load_workload(str(tiny)), seed=5)
    scripts = book.step(1)
    by_task: dict[int, list[str]] = {}
    for script in scripts:
        text = prompt_text(script)
        assert len(text) == script.prompt_tokens and text.endswith(f"[sample={script.sample}]")
        by_task.setdefault(script.task_seed, []).append(text)
    siblings = next(texts for texts in by_task.values() if len(texts) > 1)
    shared = len(siblings[0]) - len(siblings[0].rsplit("\n", 1)[1])
    assert siblings[0][:shared] == siblings[1][:shared] and siblings[0] != siblings[1]
    first, second = (texts[0] for texts in list(by_task.values())[:2])
    assert first.split("\n", 1)[0] != second.split("\n", 1)[0]  # other tasks: other tags
