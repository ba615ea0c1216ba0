"""What the engine publishes of its trajectories (``libra.events``): each one's start and
end, each generation call and tool call, and each move between buckets, with the tool
return that came before it (the signal C-MLFQ moved it on)."""

from __future__ import annotations

from libra.engine._records import ToolReturnRecord, TrajectoryRecord
from libra.events import (
    BucketMoved,
    CallEnded,
    EventBus,
    ToolEnded,
    TrajectoryEnded,
    TrajectoryStarted,
)
from libra.sched import Route


class TrajectoryEvents:
    """Publishes to ``bus``; remembers of each live trajectory its last bucket and tool."""

    def __init__(self, bus: EventBus) -> None:
        self.bus = bus
        self._bucket: dict[str, str] = {}
        self._tool: dict[str, ToolEnded] = {}

    def started(self, key: str, env: str, step: int, task: str) -> None:
        self.bus.publish(TrajectoryStarted(t=self.bus.t(), id=key, env=env, step=step, task=task))

    def call(
        self,
        key: str,
        turn: int,
        route: Route,
        seconds: float,
        tokens: tuple[int, int],
        outcome: str,
    ) -> None:
        """``tokens``: the call's prompt and what it sampled."""
        t = self.bus.t()
        last = self._bucket.get(key)
        if last is not None and last != route.bucket:
            tool = self._tool.get(key)
            self.bus.publish(
                BucketMoved(
                    t=t,
                    id=key,
                    source=last,
                    target=route.bucket,
                    tool=tool.tool if tool else None,
                    status=tool.status if tool else None,
                )
            )
        self._bucket[key] = route.bucket
        self.bus.publish(
            CallEnded(
                t=t,
                id=key,
                turn=turn,
                instance=route.endpoint.name,
                bucket=route.bucket,
                seconds=seconds,
                new_tokens=tokens[1],
                outcome=outcome,
                weight_version=route.weight_version,
                prompt_tokens=tokens[0],
            )
        )

    def tool(self, key: str, tool: ToolReturnRecord) -> None:
        event = ToolEnded(
            t=self.bus.t(), id=key, tool=tool.tool, status=tool.status, seconds=tool.latency_s
        )
        self._tool[key] = event
        self.bus.publish(event)

    def forget(self, key: str) -> None:
        """``key`` makes no more calls (a gateway completion, which has no record)."""
        self._bucket.pop(key, None)
        self._tool.pop(key, None)

    def ended(self, record: TrajectoryRecord) -> None:
        self.forget(record.id)
        self.bus.publish(
            TrajectoryEnded(
                t=self.bus.t(),
                id=record.id,
                status=record.status,
                stop_reason=record.stop_reason,
                reward=record.reward,
                turns=record.turns,
                tokens=sum(record.loss_mask),
                seconds=record.timings.total_s,
            )
        )
