"""The emulated GPU: a latency model and a continuous-batching engine that applies it.

:class:`LatencyModel` holds the cost figures (prefill seconds per prompt token, decode
step time as a function of batch size and context, batch and KV-cache limits).
:class:`BatchingEngine` plays vLLM's scheduler with them: admitted requests prefill,
join the running batch at the next step, and advance one token per step; requests that
would not fit the KV budget or the batch wait in a queue ordered by ``priority`` (lower
first) then arrival.

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
from dataclasses import dataclass, field
from typing import Literal

import anyio
from pydantic import BaseModel, ConfigDict, Field

# Figures behind LatencyModel's defaults: one H100 SXM 80 GB serving a Qwen3-4B-sized model
# in bf16, derived from datasheet numbers (DESIGN.md §5), not measured. Illustrative until
# the scheduler work calibrates them.
_HBM_BYTES_PER_S = 3.35e12 * 0.85  # 3.35 TB/s at ~85% achieved bandwidth
_DENSE_FLOPS = 990e12 * 0.55  # 990 TFLOP/s dense bf16 at ~55% utilisation in prefill
_PARAMETERS = 4.0e9
_KV_BYTES_PER_TOKEN = 2 * 36 * 8 * 128 * 2  # K and V x layers x KV heads x head dim x bf16
_KV_BUDGET_BYTES = 80e9 * 0.9 - 2 * _PARAMETERS - 4e9  # gpu_memory_utilization 0.9 - weights
#                                                       - ~4 GB activations and graphs


class LatencyModel(BaseModel):
    """Cost model of one emulated inference server (times in seconds, sizes in tokens).

    A request spends ``prefill_s_per_token * prompt_tokens`` in prefill, then joins the
    running batch; each decode step of a batch of ``B`` sequences holding ``C`` context
    tokens in total takes ``step_base_s + step_per_seq_s * B + step_per_ctx_token_s * C``
    and gives every sequence in the batch one token.

    The defaults resemble a 4B-parameter model in bf16 on one H100 (weights read once per
    step, KV cache read per context token, prefill compute-bound); they are derived from
    datasheet figures and are illustrative, not measured.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    prefill_s_per_token: float = Field(
        default=round(2 * _PARAMETERS / _DENSE_FLOPS, 7),
        ge=0,
        description="Seconds of prefill per prompt token (2 FLOPs per parameter per token).",
    )
    step_base_s: float = Field(
        default=0.005,
        ge=0,
        description="Fixed seconds per decode step: reading the weights once (~2.8 ms) "
        "plus scheduling, sampling and launch overheads.",
    )
    step_per_seq_s: float = Field(
        default=3e-5,
        ge=0,
        description="Extra seconds per decode step for each sequence in the batch.",
    )
    step_per_ctx_token_s: float = Field(
        default=round(_KV_BYTES_PER_TOKEN / _HBM_BYTES_PER_S, 10),
        ge=0,
        description="Extra seconds per decode step for each context token in the batch "
        "(reading its KV cache: 144 KiB per token).",
    )
    max_num_seqs: int = Field(
        default=256, ge=1, description="Most sequences in the running batch (vLLM's max_num_seqs)."
    )
    kv_capacity_tokens: int = Field(
        default=int(_KV_BUDGET_BYTES // _KV_BYTES_PER_TOKEN),
        ge=1,
        description="Tokens the KV cache holds; a request needs prompt + new tokens of it.",
    )

    @classmethod
    def zero(cls) -> LatencyModel:
        """No waiting at all: the server answers at once, without a batching loop."""
        return cls(
            prefill_s_per_token=0.0,
            step_base_s=0.0,
            step_per_seq_s=0.0,
            step_per_ctx_token_s=0.0,
            max_num_seqs=1 << 30,
            kv_capacity_tokens=1 << 62,
        )

    @property
    def is_zero(self) -> bool:
        """True when no request ever waits (no time costs, no limit a server could hit)."""
        return self == LatencyModel.zero()

    def prefill_time(self, prompt_tokens: int) -> float:
        """Seconds of prefill for a prompt of ``prompt_tokens``."""
        return self.prefill_s_per_token * prompt_tokens

    def step_time(self, batch_size: int, context_tokens: int) -> float:
        """Seconds of one decode step for ``batch_size`` sequences of ``context_tokens``."""
        return (
            self.step_base_s
            + self.step_per_seq_s * batch_size
            + self.step_per_ctx_token_s * context_tokens
        )


SequenceState = Literal["waiting", "running", "done", "aborted"]


@dataclass(eq=False, slots=True)
class _Sequence:
    """One request inside the engine."""

    prompt_tokens: int
    new_tokens: int
    priority: int
    arrival: int
    state: SequenceState = "waiting"
    produced: int = 0
    joins_at: float = math.inf  # when prefill ends; the sequence joins the next step after
    is_driver: bool = False
    # Set once: when the sequence is done, or when it is handed the driver role.
    wakeup: anyio.Event = field(default_factory=anyio.Event)

    @property
    def kv_reservation(self) -> int:
        return self.prompt_tokens + self.new_tokens

    @property
    def context_tokens(self) -> int:
        return self.prompt_tokens + self.produced


class BatchingEngine:
    """vLLM-style continuous batching over a :class:`LatencyModel`, in anyio time.

    Admission: the head of the waiting queue (lowest ``priority``, then earliest arrival)
    is admitted while the batch has room (``max_num_seqs``) and the KV cache can hold its
    prompt plus all the tokens it will generate; the queue is served strictly in order,
    like vLLM's scheduler, which stops at the first request it cannot place. The emulator
    knows each reply's length in advance, so it reserves exactly what the request will
    use; vLLM allocates blocks as tokens are produced and preempts on overflow, which this
    rule approximates without preemption. A request larger than the whole cache is
    admitted alone rather than waiting forever.

    Prefill: an admitted request prefills for ``prefill_time(prompt)`` (concurrently with
    the running batch) and joins the first decode step that starts after that.
    """

    def __init__(self, latency: LatencyModel) -> None:
        self.latency = latency
        self._waiting: list[tuple[int, int, _Sequence]] = []  # heap of (priority, arrival, seq)
        self._num_waiting = 0
        self._running: list[_Sequence] = []
        self._kv_reserved = 0
        self._kv_used = 0
        self._driver: _Sequence | None = None
        self._clock = -math.inf  # end of the last decode step, in anyio time
        self._step: tuple[float, list[_Sequence]] | None = None  # in flight: (end, batch)
        self._arrivals = itertools.count()
        # Wakes a driver that waits for prefills to end; made in _wait_for_prefill, since an
        # anyio.Event can only be created inside a running event loop.
        self._admitted: anyio.Event | None = None

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
        return self._kv_used

    @property
    def kv_usage(self) -> float:
        """Fraction of the KV cache in use, 0–1 (vLLM's ``kv_cache_usage_perc``)."""
        return min(1.0, self._kv_used / self.latency.kv_capacity_tokens)

    # ------------------------------------------------------------------------ requests

    async def generate(self, prompt_tokens: int, new_tokens: int, *, priority: int = 0) -> None:
        """Wait until a request of ``prompt_tokens`` has produced ``new_tokens`` tokens.

        Cancelling the caller aborts the request and frees its batch slot and KV space.
        """
        if prompt_tokens < 0 or new_tokens < 1:
            raise ValueError("a request needs prompt_tokens >= 0 and new_tokens >= 1")
        sequence = _Sequence(prompt_tokens, new_tokens, priority, next(self._arrivals))
        heapq.heappush(self._waiting, (priority, sequence.arrival, sequence))
        self._num_waiting += 1
        self._admit(anyio.current_time())
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

    # ---------------------------------------------------------------------- the loop

    async def _drive(self, me: _Sequence) -> None:
        """Run decode steps until ``me`` is done; other sequences advance alongside."""
        while me.state != "done":
            if self._step is None:  # else resume the step a cancelled driver left in flight
                now = max(self._clock, anyio.current_time())
                batch = [sequence for sequence in self._running if sequence.joins_at <= now]
                if not batch:
                    await self._wait_for_prefill()
                    continue
                context = sum(sequence.context_tokens for sequence in batch)
                self._step = (now + self.latency.step_time(len(batch), context), batch)
            end, batch = self._step
            await anyio.sleep_until(end)
            self._step = None
            self._clock = end
            for sequence in batch:
                if sequence.state == "running":  # not aborted during the step
                    self._advance(sequence)
            self._admit(end)

    async def _wait_for_prefill(self) -> None:
        """Sleep until the first running sequence ends prefill, or a new one is admitted."""
        self._admitted = anyio.Event()
        first_join = min(sequence.joins_at for sequence in self._running)
        with anyio.CancelScope(deadline=first_join):
            await self._admitted.wait()

    def _advance(self, sequence: _Sequence) -> None:
        sequence.produced += 1
        self._kv_used += 1
        if sequence.produced >= sequence.new_tokens:
            sequence.state = "done"
            self._release(sequence)
            sequence.wakeup.set()

    # -------------------------------------------------------------- queue and batch

    def _admit(self, now: float) -> None:
        """Move waiting sequences into the batch, in queue order, while they fit."""
        admitted_any = False
        while self._waiting and len(self._running) < self.latency.max_num_seqs:
            head = self._waiting[0][2]
            if head.state != "waiting":  # aborted while queued; drop it lazily
                heapq.heappop(self._waiting)
                continue
            fits = self._kv_reserved + head.kv_reservation <= self.latency.kv_capacity_tokens
            if self._running and not fits:
                break
            heapq.heappop(self._waiting)
            self._num_waiting -= 1
            head.state = "running"
            head.joins_at = now + self.latency.prefill_time(head.prompt_tokens)
            self._running.append(head)
            self._kv_reserved += head.kv_reservation
            self._kv_used += head.prompt_tokens
            admitted_any = True
        if admitted_any and self._admitted is not None:
            self._admitted.set()

    def _release(self, sequence: _Sequence) -> None:
        """Take a running sequence out of the batch and free its KV space."""
        self._running.remove(sequence)
        self._kv_reserved -= sequence.kv_reservation
        self._kv_used -= sequence.context_tokens

    def _abort(self, sequence: _Sequence) -> None:
        if sequence.state == "waiting":
            self._num_waiting -= 1  # its heap entry is dropped when it reaches the head
        else:
            self._release(sequence)
        sequence.state = "aborted"
        self._admit(anyio.current_time())

    # -------------------------------------------------------------- the driver role

    def _make_driver(self, sequence: _Sequence) -> None:
        sequence.is_driver = True
        self._driver = sequence
        sequence.wakeup.set()

    def _hand_over(self, sequence: _Sequence) -> None:
        """Give the driver role to a running sequence, if any is left."""
        sequence.is_driver = False
        self._driver = None
        if self._running:
            self._make_driver(self._running[0])
        else:
            self._step = None  # nobody left to finish it
