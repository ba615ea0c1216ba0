"""Least-loaded routing: verl's default, and Libra's default until buckets are configured.

Picks the endpoint with the fewest calls in flight. Ties go to the endpoint that served
the trajectory's previous turn (its prefix is cached there), then in turn order, so an
idle fleet is filled evenly.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from libra.fleet import Endpoint
from libra.sched._protocol import NoEndpointAvailable, Route, RouteRequest
from libra.signals import ToolSignal


class LeastLoadedScheduler:
    def __init__(self, endpoints: Sequence[Endpoint]) -> None:
        if not endpoints:
            raise ValueError("a scheduler needs at least one endpoint")
        self.endpoints = list(endpoints)
        self.in_flight = {e.name: 0 for e in self.endpoints}
        self._turn = itertools.count()

    def route(self, request: RouteRequest, exclude: frozenset[str] = frozenset()) -> Route:
        candidates = [e for e in self.endpoints if e.name not in exclude]
        if not candidates:
            raise NoEndpointAvailable(f"all {len(self.endpoints)} endpoints are excluded")
        start = next(self._turn) % len(candidates)
        rotated = candidates[start:] + candidates[:start]

        def load(e: Endpoint) -> tuple[int, bool]:
            return self.in_flight[e.name], e is not request.previous

        endpoint = min(rotated, key=load)
        self.in_flight[endpoint.name] += 1
        return Route(endpoint)

    def release(self, route: Route, *, ok: bool, new_tokens: int) -> None:
        self.in_flight[route.endpoint.name] -= 1

    def on_tool_return(self, trajectory_id: str, signal: ToolSignal) -> None:
        pass  # load balancing ignores the causal signal; C-MLFQ feeds on it

    def on_finish(
        self, trajectory_id: str, prompt_id: str, *, output_tokens: int, failed: bool = False
    ) -> None:
        pass

    def calls_in_flight(self) -> dict[str, int]:
        return dict(self.in_flight)
