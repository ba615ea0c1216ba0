"""Whether generation calls are coming back at all: an engine-wide watch, and a warning.

A fleet that hangs shows no error: calls go out and nothing returns. Every generation
call of the engine passes through one :class:`GenerationWatch`; a rollout runs
:func:`warn_while_stalled` beside its trajectories, which says so on stderr (once per
interval) while calls are in flight and none has returned for a while.
"""

from __future__ import annotations

import logging
import math

import anyio

from libra._clock import now

log = logging.getLogger("libra.engine")


class GenerationWatch:
    """Generation calls in flight, and when the last one returned."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.last_return = -math.inf
        self.busy_since = -math.inf  # when calls were last in flight after none were
        self.last_failure = ""

    def started(self) -> None:
        """A generation call went out (each is ``ended`` once, however it ends)."""
        if self.in_flight == 0:
            self.busy_since = now()
        self.in_flight += 1

    def ended(self) -> None:
        self.in_flight -= 1

    def returned(self, at: float) -> None:
        """A call returned at ``at`` (anyio's clock)."""
        self.last_return = at

    def failed(self, error: str) -> None:
        self.last_failure = error

    def quiet_s(self) -> float:
        """How long calls have been in flight with none returning (0 if none are)."""
        if not self.in_flight:
            return 0.0
        return anyio.current_time() - max(self.last_return, self.busy_since)


async def warn_while_stalled(watch: GenerationWatch, after_s: float) -> None:
    """Forever: warn when ``watch`` has been quiet for ``after_s``, at most once per
    ``after_s`` (checked four times as often, so a stall is told soon after it starts)."""
    warned = -math.inf
    while True:
        await anyio.sleep(after_s / 4)
        quiet = watch.quiet_s()
        now = anyio.current_time()
        if quiet >= after_s and now - warned >= after_s:
            warned = now
            last = f" (last failure: {watch.last_failure})" if watch.last_failure else ""
            log.warning(
                "no generation has returned for %.0f s; %d calls in flight%s",
                quiet,
                watch.in_flight,
                last,
            )
