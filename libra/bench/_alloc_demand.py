"""What the next step of ``libra bench alloc`` will ask of the workers (the planner's
:class:`~libra.alloc.Workload`), from the recent steps' records or the earlier steps'
scripts."""

from __future__ import annotations

from libra.alloc import Workload as Demand
from libra.emulation.workloads import TrajectoryScript
from libra.engine import TrajectoryRecord


def demand_of_records(steps: list[list[TrajectoryRecord]]) -> Demand:
    """What the next step will ask, from the recent steps' records pooled."""
    records = [record for records in steps for record in records]
    return Demand(
        trajectories=len(steps[-1]),
        output_tokens=tuple(sum(record.loss_mask) for record in records),
        context_tokens=tuple(len(record.token_ids) for record in records),
        turns=tuple(record.turns for record in records),
        tool_s=tuple(record.timings.tool_s for record in records),
    )


def demand_of_scripts(scripts: list[TrajectoryScript]) -> Demand:
    """The same, from the earlier steps' scripts (what a run saw before this one)."""
    per_step = len(scripts) // max(1, len({s.step for s in scripts}))
    return Demand(
        trajectories=per_step,
        output_tokens=tuple(sum(turn.output_tokens for turn in s.turns) for s in scripts),
        context_tokens=tuple(script_tokens(s) for s in scripts),
        turns=tuple(len(s.turns) for s in scripts),
        tool_s=tuple(s.tool_s for s in scripts),
    )


def script_tokens(script: TrajectoryScript) -> int:
    """Prompt, outputs and tool returns (the byte tokenizer: a character is a token)."""
    return script.prompt_tokens + sum(t.output_tokens + t.output_chars for t in script.turns)
