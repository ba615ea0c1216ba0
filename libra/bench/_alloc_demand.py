"""What the next step of ``libra bench alloc`` will ask of the workers (the planner's
:class:`~libra.alloc.Demand`), from the recent steps' records or the earlier steps'
scripts."""

from __future__ import annotations

from libra.alloc import Demand
from libra.emulation.workloads import TrajectoryScript
from libra.engine import TrajectoryRecord


def demand_of_records(steps: list[list[TrajectoryRecord]]) -> Demand:
    """What the next step will ask, from the recent steps' records pooled."""
    records = [record for records in steps for record in records]
    return Demand.of_records(records, trajectories=len(steps[-1]))


def demand_of_scripts(scripts: list[TrajectoryScript]) -> Demand:
    """The same, from the earlier steps' scripts (what a run saw before this one)."""
    per_step = len(scripts) // max(1, len({s.step for s in scripts}))
    return Demand(
        trajectories=per_step,
        output_tokens=tuple(sum(turn.output_tokens for turn in s.turns) for s in scripts),
        context_tokens=tuple(script_tokens(s) for s in scripts),
        turns=tuple(len(s.turns) for s in scripts),
        tool_s=tuple(s.tool_s for s in scripts),
        decode_context_tokens=tuple(map(_decode_context, scripts)),
    )


def _decode_context(script: TrajectoryScript) -> float:
    """The mean context its tokens are decoded at: each turn's output on the context
    before it (the prompt, earlier outputs and tool returns) plus half its own."""
    context, weighted = script.prompt_tokens, 0.0
    for turn in script.turns:
        weighted += turn.output_tokens * (context + turn.output_tokens / 2)
        context += turn.output_tokens + turn.output_chars
    return weighted / max(1, script.output_tokens)


def script_tokens(script: TrajectoryScript) -> int:
    """Prompt, outputs and tool returns (the byte tokenizer: a character is a token)."""
    return script.prompt_tokens + sum(t.output_tokens + t.output_chars for t in script.turns)
