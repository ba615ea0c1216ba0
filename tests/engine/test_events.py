"""What the engine publishes: one start and one end per trajectory, each generation call
on its instance and bucket, each tool call, and each move between buckets with the tool
return before it, on a C-MLFQ rollout of the tiny agent workload (virtual time)."""

from __future__ import annotations

from collections import Counter, defaultdict
from pathlib import Path

from libra.bench._emulated_fleet import MODEL, engine_config, in_virtual_time
from libra.bench._sched import _fleet_apps
from libra.bench._sched_fleet import load_fleet
from libra.bench._sched_history import replay_history
from libra.emulation import FleetApp
from libra.emulation.workloads import EnvClasses, ScriptBook, load_workload
from libra.engine import ASGITransport, Engine, TrajectoryJob, TrajectoryRecord, rollout
from libra.envs import Task
from libra.events import (
    AnyEvent,
    BucketMoved,
    CallEnded,
    EventBus,
    ToolEnded,
    TrajectoryEnded,
    TrajectoryStarted,
)
from libra.sched.policies import make_policy

WORKLOAD = Path(__file__).parents[2] / "docs" / "bench" / "tiny-agent.toml"


async def cmlfq_rollout() -> tuple[list[AnyEvent], list[TrajectoryRecord]]:
    workload, fleet = load_workload(str(WORKLOAD)), load_fleet()
    book = ScriptBook(workload, 0)
    step = workload.rollout.history_steps
    policy = make_policy("cmlfq", fleet.spec(MODEL))
    replay_history(policy, book, step)
    apps, _ = _fleet_apps(workload, fleet, book, 0)
    env_classes = EnvClasses(book)
    jobs = [
        TrajectoryJob(env_classes(step, s.sample), Task(s.task_id, s.task_seed), s.sample, step)
        for s in book.step(step)
    ]
    bus = EventBus()
    events = bus.subscribe()
    records: list[TrajectoryRecord] = []
    async with ASGITransport(FleetApp(apps)) as http:
        engine = Engine(http, policy, config=engine_config(workload, len(jobs), 0), events=bus)
        await rollout(jobs, engine, on_record=records.append)
    return events.take(), records  # type: ignore[return-value]


def test_every_trajectory_call_tool_and_move_is_published() -> None:
    events, records = in_virtual_time(cmlfq_rollout, seed=0)
    by_kind = Counter(type(event) for event in events)
    assert by_kind[TrajectoryStarted] == by_kind[TrajectoryEnded] == len(records) == 18
    ended = {e.id: e for e in events if isinstance(e, TrajectoryEnded)}
    calls: defaultdict[str, list[CallEnded]] = defaultdict(list)
    for event in events:
        if isinstance(event, CallEnded):
            calls[event.id].append(event)
    for record in records:
        end = ended[record.id]
        assert (end.status, end.turns, end.reward) == (record.status, record.turns, record.reward)
        assert end.tokens == sum(record.loss_mask)
        # (a turn that reached its route's quantum went on in another call)
        ok = [call for call in calls[record.id] if call.outcome == "ok"]
        assert len(ok) >= record.turns and {c.instance for c in ok} >= set(record.endpoints)
        assert sum(call.new_tokens for call in ok) == sum(record.loss_mask)
        tools = [e for e in events if isinstance(e, ToolEnded) and e.id == record.id]
        assert [(e.tool, e.status) for e in tools] == [
            (tool.tool, tool.status) for tool in record.tool_returns
        ]
    # C-MLFQ moved some trajectories between buckets on their tool returns.
    moves = [e for e in events if isinstance(e, BucketMoved)]
    assert moves and all(move.source != move.target for move in moves)
    assert all(move.tool is not None for move in moves)
    for move in moves:
        later = [c for c in calls[move.id] if c.t >= move.t]
        assert later[0].bucket == move.target
    # Each trajectory's events come in order: start, its calls and tools, its end.
    order = [type(e) for e in events if getattr(e, "id", None) == records[0].id]
    assert order[0] is TrajectoryStarted and order[-1] is TrajectoryEnded
