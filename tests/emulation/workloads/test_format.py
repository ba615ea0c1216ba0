"""The workload format's validation, with or without a file."""

from __future__ import annotations

from pathlib import Path

import pytest

from libra.emulation.workloads import Workload, WorkloadError, draw_script, load_workload
from tests._helpers import USER_WORKLOAD, write


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (("prompts = 24", "prompts = 24\nbatch = 3"), "rollout.batch: Extra inputs"),
        (("min = 96", "min = 10"), "turn.tokens.min must be at least 96"),
        (('name = "data-agent"', 'name = "Data Agent"'), "name: String should match"),
        (("max_turns = 10", "max_turns = 1"), "allow a tool turn and a final answer"),
        (("alpha = 1.0", "alpha = -1.0"), "solve_rate.alpha"),
        (("calls_first_attempt = [1, 2]", "calls_first_attempt = [2, 1]"), "call ranges"),
    ],
)
def test_invalid_workloads_are_refused_with_the_field_named(
    tmp_path: Path, change: tuple[str, str], message: str
) -> None:
    path = write(tmp_path, USER_WORKLOAD.replace(*change, 1))
    with pytest.raises(WorkloadError, match=message):
        load_workload(str(path))


def test_workload_objects_validate_without_a_file() -> None:
    data = {
        "name": "tiny",
        "rollout": {"prompts": 1, "samples_per_prompt": 1},
        "limits": {"max_turns": 2, "max_context_tokens": 1000},
        "prompt_tokens": {"median": 100},
        "solve_rate": {"alpha": 1, "beta": 1},
        "turn": {"tokens": {"median": 100, "min": 96}, "final_tokens": {"median": 5, "min": 1}},
        "check": {
            "name": "check",
            "latency_s": {"median": 1},
            "on_pass": {"chars": {"median": 10}},
            "on_fail": {"status": "failure", "chars": {"median": 10}},
        },
    }
    script = draw_script(Workload.model_validate(data), 0, 1, 0)
    assert len(script.turns) == 2 and script.turns[0].tool == "check"
