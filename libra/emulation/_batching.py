"""The emulated GPU's scheduler: a continuous-batching engine that plays a
:class:`LatencyModel` as vLLM's scheduler would.

:class:`BatchingEngine` plays vLLM's scheduler with the model's figures: admitted
requests prefill, join the running batch at the next step, and advance one token per
step; requests that would not fit the KV budget or the batch wait in a queue ordered by
``priority`` (lower first) then arrival. With on-demand KV allocation (vLLM's), a request
holds only the tokens it has so far, and when the running batch outgrows the cache the
lowest-priority running request is preempted and recomputed later, as vLLM's priority
scheduler does.

All waiting goes through anyio (``sleep_until``, ``current_time``, events), so the engine
runs on asyncio and on trio, and under ``trio.testing.MockClock`` a whole benchmark runs
in virtual time.

No background task is spawned: the loop is driven by one of the requests it serves
(the *driver*). The first request to find the engine idle becomes the driver; when the
driver's own sequence finishes (or its caller is cancelled) it hands the role to another
running request. That works wherever the requests run — under uvicorn, or in-process
through ``httpx.ASGITransport``, which sends no ASGI lifespan events — and leaves no task
behind when the last request ends.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections.abc import Callable
from typing import Literal

import anyio

from libra.emulation._batch_plan import Segment, Sequence
from libra.emulation._latency import LatencyModel

PauseMode = Literal["abort", "wait", "keep"]
"""vLLM's ``/pause`` modes: end everything in flight now (with the tokens produced so
far), let the running requests finish, or freeze them until ``resume``. In every mode
new requests queue until ``resume``."""
Observer = Callable[[float, int, int], None]
"""Called with (time, requests running, requests waiting) whenever either count changes."""


class BatchingEngine:
    """vLLM-style continuous batching over a :class:`LatencyModel`, in anyio time.

    Admission: the head of the waiting queue (lowest ``priority``, then earliest arrival)
    is admitted while the batch has room (``max_num_seqs``) and the KV cache has room for
    it; the queue is served strictly in order, like vLLM's scheduler, which stops at the
    first request it cannot place. What "room" means is the latency model's
    ``kv_allocation``: under ``reserve`` the request's prompt plus every token it will
    generate (the emulator knows each reply's length), so nothing is ever preempted;
    under ``on_demand`` (vLLM's) its context plus one token. A request larger than the
    whole cache is admitted alone rather than waiting forever.

    Preemption (``on_demand`` only), as vLLM's scheduler does it: before a decode step,
    while the running requests (decoding or prefilling) would need more room than the
    cache has, the lowest-priority one (highest ``priority``, then latest arrival) is
    preempted: its KV is freed and it goes back to the waiting queue under its original
    priority and arrival, keeping the tokens it produced; when admitted again it
    prefills its whole context anew (recompute). The last running request is never
    preempted.

    Prefill: an admitted request prefills for ``prefill_time`` of its prompt tokens that
    are not already cached (concurrently with the running batch) and joins the first
    decode step that starts after that.

    Time: decode advances in runs of steps over an unchanged batch (see ``Segment``),
    planned to end when the first sequence finishes or a prefilling one is due to join.
    An arrival or an abort cuts the run at the next step boundary. Every observation
    (metrics, finishing times) is the same as stepping token by token, but a benchmark
    costs a few wake-ups per request instead of one per generated token.

    Pause (vLLM's ``/pause``): no mode admits a queued request until :meth:`resume`;
    ``abort`` stops every request in flight at once (its caller gets the tokens produced
    so far), ``wait`` lets the running batch finish, ``keep`` freezes it after the step in
    flight and goes on from there on resume.

    ``busy_s`` is the time during which at least one request was running (prefilling or
    decoding); ``observer``, if set, hears every change of the running and waiting counts.
    """

    def __init__(
        self, latency: LatencyModel, observer: Observer | None = None, *, seed: int = 0
    ) -> None:
        self.latency = latency
        self.observer = observer
        self._jitter = random.Random(f"jitter:{seed}")
        self._waiting: list[tuple[int, int, Sequence]] = []  # heap of (priority, arrival, seq)
        self._num_waiting = 0
        self._running: list[Sequence] = []
        self._kv_reserved = 0
        self._kv_used = 0  # as of the last credited step (see _pending_kv)
        self._driver: Sequence | None = None
        self._clock = -math.inf  # end of the last decode step, in anyio time
        self._segment: Segment | None = None  # the run of steps under way
        self._arrivals = itertools.count()
        # Wakes the driver when the batch must change; made where the driver waits, since
        # an anyio.Event can only be created inside a running event loop.
        self._changed: anyio.Event | None = None
        self._busy_s = 0.0
        self._busy_since: float | None = None
        self._pause: PauseMode | None = None
        self._idle: anyio.Event | None = None  # set when the last running request leaves
        self._preemptions = 0

    # ------------------------------------------------------------------------- metrics

    @property
    def num_running(self) -> int:
        """Requests admitted to the batch (prefilling or decoding)."""
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        """Requests queued for a batch slot or KV space."""
        return self._num_waiting

    @property
    def kv_used_tokens(self) -> int:
        """Tokens currently held in the KV cache (prompts plus tokens produced so far)."""
        return self._kv_used + self._pending_kv()

    @property
    def kv_usage(self) -> float:
        """Fraction of the KV cache in use, 0–1 (vLLM's ``kv_cache_usage_perc``)."""
        return min(1.0, self.kv_used_tokens / self.latency.kv_capacity_tokens)

    @property
    def num_preemptions(self) -> int:
        """Requests preempted so far (vLLM's ``num_preemptions``)."""
        return self._preemptions

    @property
    def busy_s(self) -> float:
        """Seconds so far during which at least one request was running."""
        if self._busy_since is None:
            return self._busy_s
        return self._busy_s + max(0.0, _now_or(self._busy_since) - self._busy_since)

    def _pending_kv(self) -> int:
        """Tokens produced by steps that have ended but are not credited yet."""
        segment = self._segment
        if segment is None:
            return 0
        done = segment.steps_done_by(_now_or(segment.start)) - segment.credited
        return done * sum(1 for sequence in segment.batch if sequence.state == "running")

    # ------------------------------------------------------------------------ requests

    async def generate(
        self, prompt_tokens: int, new_tokens: int, *, priority: int = 0, cached_tokens: int = 0
    ) -> int:
        """Wait until a request of ``prompt_tokens`` has produced ``new_tokens`` tokens;
        return how many it produced (fewer when a pause in abort mode stopped it).

        ``cached_tokens`` of the prompt are in the prefix cache and need no prefill.
        Cancelling the caller aborts the request and frees its batch slot and KV space.
        """
        if prompt_tokens < 0 or new_tokens < 1:
            raise ValueError("a request needs prompt_tokens >= 0 and new_tokens >= 1")
        prefill = prompt_tokens - min(max(cached_tokens, 0), prompt_tokens)
        sequence = Sequence(prompt_tokens, new_tokens, priority, next(self._arrivals), prefill)
        now = anyio.current_time()
        self._sync(now)
        heapq.heappush(self._waiting, (priority, sequence.arrival, sequence))
        self._num_waiting += 1
        self._admit(now)
        self._observe(now)
        if self._driver is None:
            self._make_driver(sequence)
        try:
            await sequence.wakeup.wait()
            if sequence.is_driver:
                await self._drive(sequence)
        finally:
            if sequence.state in ("waiting", "running"):
                self._abort(sequence)
            if sequence.is_driver:
                self._hand_over(sequence)
        return sequence.produced

    # ------------------------------------------------------------------------- pause

    @property
    def paused(self) -> PauseMode | None:
        """The mode of the pause in force, or None."""
        return self._pause

    def pause(self, mode: PauseMode) -> None:
        """Stop admitting requests; ``abort`` also stops those in flight, ``keep``
        freezes the running batch after the step in flight (see the class docstring)."""
        now = anyio.current_time()
        self._sync(now)
        self._pause = mode
        if mode == "abort":
            self._stop_all(now)
        elif mode == "keep":
            self._cut(now)
        self._observe(now)

    async def wait_until_idle(self) -> None:
        """Return once no request is running (queued ones may wait)."""
        while self._running:
            self._idle = self._idle or anyio.Event()
            await self._idle.wait()

    def resume(self) -> None:
        """End the pause: queued requests are admitted, a frozen batch goes on."""
        if self._pause is None:
            return
        self._pause = None
        now = anyio.current_time()
        self._admit(now)
        self._notify()
        self._observe(now)

    def _stop_all(self, now: float) -> None:
        """End every request in flight now, with the tokens produced so far."""
        stopped = [s for s in self._running]
        stopped += [entry[2] for entry in self._waiting if entry[2].state == "waiting"]
        self._waiting.clear()
        self._num_waiting = 0
        for sequence in stopped:
            if sequence.state == "running":
                self._release(sequence, now)
            sequence.state = "stopped"
            sequence.wakeup.set()
        self._segment = None  # the step in flight is dropped with the batch it served
        self._clock = max(self._clock, now)
        self._notify()

    # ---------------------------------------------------------------------- the loop

    async def _drive(self, me: Sequence) -> None:
        """Run decode steps until ``me`` is over; other sequences advance alongside."""
        while me.state in ("waiting", "running"):
            if self._segment is None and self._pause != "keep":  # else resume a left run
                self._segment = self._plan(max(self._clock, anyio.current_time()))
            if self._segment is None:  # nothing to decode: prefilling, queued or frozen
                joining = (s.joins_at for s in self._running if self._pause != "keep")
                await self._wait_for_change(min(joining, default=math.inf))
                continue
            await self._wait_for_change(self._segment.end)
            self._sync(anyio.current_time())

    def _plan(self, now: float) -> Segment | None:
        """The run of steps from ``now``: until the first finish, the next join or, under
        on-demand allocation, the step that would outgrow the cache."""
        self._make_room(now)
        batch = [sequence for sequence in self._running if sequence.joins_at <= now]
        if not batch:
            return None
        latency = self.latency
        size = len(batch)
        context = sum(sequence.context_tokens for sequence in batch)
        joining = [s.joins_at for s in self._running if s.joins_at > now]
        slowdown = self._slowdown(prefilling=bool(joining))
        segment = Segment(
            start=now,
            batch=batch,
            first=latency.step_time(size, context) * slowdown,
            growth=latency.step_per_ctx_token_s * size * slowdown,
            target=min(sequence.remaining for sequence in batch),
        )
        if joining:
            # The run ends where the prefill does, so only the shared steps are slowed.
            segment.target = segment.first_end_at_or_after(min(joining))
        room = self._steps_with_room(size)
        if room is not None:
            segment.target = min(segment.target, room)
        return segment

    def _steps_with_room(self, decoding: int) -> int | None:
        """Steps of ``decoding`` sequences the cache has room for before preemption must
        free some (on-demand allocation, more than one request running); else None."""
        if self.latency.kv_allocation != "on_demand" or len(self._running) < 2:
            return None
        free = self.latency.kv_capacity_tokens - self.kv_used_tokens
        return max(1, free // max(1, decoding))

    def _make_room(self, now: float) -> None:
        """Preempt the lowest-priority running requests until the next step fits (see the
        class docstring)."""
        if self.latency.kv_allocation != "on_demand":
            return
        capacity = self.latency.kv_capacity_tokens
        while len(self._running) > 1:
            decoding = sum(1 for sequence in self._running if sequence.joins_at <= now)
            if self.kv_used_tokens + decoding <= capacity:
                return
            victim = max(self._running, key=lambda sequence: (sequence.priority, sequence.arrival))
            self._preempt(victim, now)

    def _preempt(self, sequence: Sequence, now: float) -> None:
        """Free ``sequence``'s KV and queue it again; it keeps its tokens, and recomputes
        its whole context when it is admitted again."""
        self._release(sequence, now)
        sequence.state = "waiting"
        sequence.joins_at = math.inf
        sequence.prefill_tokens = sequence.context_tokens
        heapq.heappush(self._waiting, (sequence.priority, sequence.arrival, sequence))
        self._num_waiting += 1
        self._preemptions += 1
        self._observe(now)

    def _slowdown(self, *, prefilling: bool) -> float:
        """How much slower than the model's formula the next run of steps is: prefill
        sharing the steps, and the run's jitter (both off by default)."""
        latency = self.latency
        factor = 1.0 + latency.prefill_interference if prefilling else 1.0
        if latency.jitter > 0:
            factor *= math.exp(self._jitter.gauss(0.0, latency.jitter))
        return factor

    async def _wait_for_change(self, deadline: float) -> None:
        """Sleep until ``deadline``, or until the batch must change sooner."""
        self._changed = anyio.Event()
        with anyio.CancelScope(deadline=deadline):
            await self._changed.wait()

    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()

    def _sync(self, now: float) -> None:
        """Credit the steps that have ended by ``now``; finish the run if it is over."""
        segment = self._segment
        if segment is None:
            return
        done = segment.steps_done_by(now)
        if done > segment.credited:
            steps = done - segment.credited
            segment.credited = done
            for sequence in segment.batch:
                if sequence.state == "running":  # not aborted during the run
                    sequence.produced += steps
                    self._kv_used += steps
        if done < segment.target:
            return
        end = segment.end
        self._segment = None
        self._clock = end
        for sequence in segment.batch:
            if sequence.state == "running" and sequence.produced >= sequence.new_tokens:
                sequence.state = "done"
                self._release(sequence, end)
                sequence.wakeup.set()
        self._admit(end)
        self._observe(end)

    def _cut(self, now: float) -> None:
        """The batch changes: end the run after the step in flight."""
        segment = self._segment
        if segment is not None:
            segment.target = min(segment.target, segment.steps_done_by(now) + 1)
            self._notify()

    # -------------------------------------------------------------- queue and batch

    def _admit(self, now: float) -> None:
        """Move waiting sequences into the batch, in queue order, while they fit."""
        admitted_any = False
        while (
            self._pause is None and self._waiting and len(self._running) < self.latency.max_num_seqs
        ):
            head = self._waiting[0][2]
            if head.state != "waiting":  # aborted while queued; drop it lazily
                heapq.heappop(self._waiting)
                continue
            if self._running and not self._fits(head):
                break
            heapq.heappop(self._waiting)
            self._num_waiting -= 1
            head.state = "running"
            head.joins_at = now + self.latency.prefill_time(head.prefill_tokens)
            if not self._running:
                self._busy_since = now
            self._running.append(head)
            self._kv_reserved += head.kv_reservation
            self._kv_used += head.context_tokens  # with the tokens it had before a preemption
            self._join_run(head, now)
            admitted_any = True
        if admitted_any:
            self._notify()

    def _fits(self, sequence: Sequence) -> bool:
        """Whether the KV cache has room to admit ``sequence`` (see the class docstring)."""
        capacity = self.latency.kv_capacity_tokens
        if self.latency.kv_allocation == "on_demand":
            return self.kv_used_tokens + sequence.context_tokens + 1 <= capacity
        return self._kv_reserved + sequence.kv_reservation <= capacity

    def _join_run(self, sequence: Sequence, now: float) -> None:
        """Cut the run under way at the first step boundary after ``sequence``'s prefill,
        or sooner when the room it takes leaves the batch too little."""
        segment = self._segment
        if segment is None:
            return
        done = segment.steps_done_by(now)
        in_flight = done + 1
        joins = max(segment.first_end_at_or_after(sequence.joins_at), in_flight)
        if self.latency.prefill_interference > 0:
            joins = in_flight  # the steps from here share the prefill: re-plan them slower
        room = self._steps_with_room(len(segment.batch))
        if room is not None:
            joins = min(joins, max(in_flight, done + room))
        segment.target = min(segment.target, joins)

    def _release(self, sequence: Sequence, now: float) -> None:
        """Take a running sequence out of the batch and free its KV space."""
        self._running.remove(sequence)
        self._kv_reserved -= sequence.kv_reservation
        self._kv_used -= sequence.context_tokens
        if not self._running and self._busy_since is not None:
            self._busy_s += max(0.0, now - self._busy_since)
            self._busy_since = None
        if not self._running and self._idle is not None:
            self._idle.set()
            self._idle = None

    def _abort(self, sequence: Sequence) -> None:
        now = anyio.current_time()
        self._sync(now)
        if sequence.state == "done":  # its last step ended just now: nothing to abort
            return
        if sequence.state == "waiting":
            self._num_waiting -= 1  # its heap entry is dropped when it reaches the head
        else:
            segment = self._segment
            if segment is not None and sequence in segment.batch:
                self._cut(now)
            self._release(sequence, now)
        sequence.state = "aborted"
        self._admit(now)
        self._observe(now)

    def _observe(self, now: float) -> None:
        if self.observer is not None:
            self.observer(now, len(self._running), self._num_waiting)

    # -------------------------------------------------------------- the driver role

    def _make_driver(self, sequence: Sequence) -> None:
        sequence.is_driver = True
        self._driver = sequence
        sequence.wakeup.set()

    def _hand_over(self, sequence: Sequence) -> None:
        """Give the driver role to a running sequence, else to a queued one (a pause
        can leave requests queued with none running), if any is left."""
        sequence.is_driver = False
        self._driver = None
        queued = (entry[2] for entry in self._waiting if entry[2].state == "waiting")
        heir = self._running[0] if self._running else next(queued, None)
        if heir is not None:
            self._make_driver(heir)
        if not self._running:
            self._segment = None  # nobody left to finish it


def _now_or(default: float) -> float:
    """anyio's clock inside an event loop; ``default`` outside one (e.g. after a run)."""
    try:
        return anyio.current_time()
    except RuntimeError:
        return default
