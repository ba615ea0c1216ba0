"""Trajectory scripts drawn from a workload: deterministic, bounded, heavy-tailed, drifting."""

from __future__ import annotations

from pathlib import Path

from libra.emulation.workloads import ScriptBook, TrajectoryScript, draw_script, load_workload
from tests._helpers import USER_WORKLOAD, write


def test_scripts_are_deterministic_per_seed_and_stay_in_the_limits() -> None:
    workload = load_workload("swe-agent")
    first, again = ScriptBook(workload, seed=1).step(2), ScriptBook(workload, seed=1).step(2)
    assert first == again
    assert ScriptBook(workload, seed=2).step(2) != first
    limits = workload.limits
    for script in first:
        assert 2 <= len(script.turns) <= limits.max_turns
        assert script.turns[-1].tool is None and all(t.tool for t in script.turns[:-1])
        context = script.prompt_tokens + sum(t.output_tokens + t.output_chars for t in script.turns)
        assert context < limits.max_context_tokens
        assert script.solved == any(turn.passed for turn in script.turns)


def test_failing_checks_mean_longer_trajectories_with_a_heavy_tail() -> None:
    scripts = ScriptBook(load_workload("swe-agent")).step(2)
    lengths = sorted(s.output_tokens for s in scripts)
    assert lengths[-1] > 2 * lengths[len(lengths) // 2]  # the tail
    solved_first = [s.output_tokens for s in scripts if _failures(s) == 0]
    failed_twice = [s.output_tokens for s in scripts if _failures(s) >= 2]
    assert sum(failed_twice) / len(failed_twice) > 1.5 * sum(solved_first) / len(solved_first)


def _failures(script: TrajectoryScript) -> int:
    return sum(1 for turn in script.turns if turn.tool == "run_tests" and not turn.passed)


def test_turns_grow_with_the_drift_across_rl_steps(tmp_path: Path) -> None:
    exact = USER_WORKLOAD.replace("sigma = 0.6, min = 96", "sigma = 0.0, min = 96")
    workload = load_workload(str(write(tmp_path, exact)))
    early = draw_script(workload, 0, 123, 0).turns[0].output_tokens
    later = draw_script(workload, 4, 123, 0).turns[0].output_tokens
    assert early == 500 and later == round(500 * 1.05**4)
