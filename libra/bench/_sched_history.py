"""What each policy is shown before the scheduling benchmark's step: the workload's
earlier steps replayed through the protocol (what a running system would have seen), and
for the oracles every trajectory's future (each turn's length and its tool's seconds)."""

from __future__ import annotations

from libra import signals
from libra.emulation.workloads import Book, ScriptTurn, TrajectoryScript, scripted_result
from libra.envs import ToolResult, ToolTimeout
from libra.sched import RouteRequest, Scheduler
from libra.sched.policies import RoutedPolicy, Truth
from libra.signals import ToolSignal


def replay_history(policy: Scheduler, book: Book, step: int) -> None:
    """Show ``policy`` the earlier steps' trajectories through the protocol, one at a
    time (what a running system would have seen), then clear its decision log."""
    if isinstance(policy, RoutedPolicy) and policy.needs_truth:
        return  # it knows the truth and learns nothing
    first = max(0, step - book.workload.history_steps)
    for earlier in range(first, step):
        for script in book.step(earlier):
            _replay(policy, script)
    if isinstance(policy, RoutedPolicy):
        policy.decisions.clear()
        policy.reasons.clear()


def _replay(policy: Scheduler, script: TrajectoryScript) -> None:
    generated, context, previous = 0, script.prompt_tokens, None
    trajectory, prompt = str(script.trajectory_id), str(script.task_id)  # as the engine's
    for index, turn in enumerate(script.turns):
        request = RouteRequest(
            trajectory,
            prompt,
            index,
            context,
            previous,
            generated_tokens=generated,
            env=script.workload,
        )
        route = policy.route(request)
        policy.release(route, outcome="ok", new_tokens=turn.output_tokens)
        previous = route.endpoint
        generated += turn.output_tokens
        context += turn.output_tokens
        if turn.tool is not None:
            policy.on_tool_return(trajectory, signal_of(turn, script.tool_timeout_s))
            context += turn.output_chars
    policy.on_finish(trajectory, prompt, output_tokens=generated)


def signal_of(turn: ScriptTurn, timeout_s: float) -> ToolSignal:
    """The signal the engine derives from a scripted tool return: the same reduction of
    the same result (the workload env's, or the engine's own when it cuts a timeout)."""
    assert turn.tool is not None, "the final answer calls no tool"
    if turn.status == "timeout":
        result = ToolResult.of_error(ToolTimeout.after(turn.tool, timeout_s))
    else:
        result = scripted_result(turn)
    return signals.signal_of(turn.tool, result.content, result.status)


def truth_of(scripts: list[TrajectoryScript]) -> Truth:
    """What the oracles are fed: every turn's output and its tool's seconds, by the
    scheduler's key (the engine's rendered trajectory id)."""
    return Truth(
        {
            str(script.trajectory_id): [
                (turn.output_tokens, tool_seconds(turn, script.tool_timeout_s))
                for turn in script.turns
            ]
            for script in scripts
        }
    )


def tool_seconds(turn: ScriptTurn, tool_timeout_s: float) -> float:
    """What a scripted turn's tool takes: its latency, or the timeout that cut it."""
    if turn.tool is None:
        return 0.0
    return tool_timeout_s if turn.status == "timeout" else turn.latency_s
