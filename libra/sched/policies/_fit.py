"""Each instance's step cost, fitted online from the calls the scheduler routes.

A policy starts from the fleet's prior (:attr:`InstanceSpec.step_cost`, a datasheet
roofline) and never reads what the servers really play. It times every call itself,
from :meth:`~libra.sched.Scheduler.route` to its ``ok`` release, on the event loop's
clock, and knows what the call asked: its prompt (the trajectory's context), the part of
it cached there (the trajectory's last call ran on the same instance), the tokens it
sampled, and the calls in flight beside it. Each call is priced term by term with the
prior (prefill; decode bytes: the base step and the context's KV; decode compute: per
sequence), and per instance one multiplicative correction per term is fitted by
:class:`~libra.fleet.Corrections`. A call sent while its instance had no free batch slot
is not learnt from: its wait is the load's, which the rules price apart.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import anyio

from libra.fleet import Corrections, StepCost
from libra.sched._instance import Instance
from libra.sched._protocol import CallOutcome, Route, RouteRequest

Terms = tuple[float, float, float]  # prefill, decode bytes, decode compute


@dataclass(frozen=True, slots=True)
class CallShape:
    """What a call asked of its instance, as the scheduler knows it when routing."""

    prompt_tokens: int
    cached_tokens: int
    concurrent: int  # calls in flight on the instance with it, its own included


def call_terms(cost: StepCost, shape: CallShape, new_tokens: int) -> Terms:
    """The prior's terms of one call: its uncached prefill, then ``new_tokens`` decode steps
    shared with ``concurrent`` sequences of about its context."""
    batch = max(1, shape.concurrent)
    context = batch * (shape.prompt_tokens + new_tokens / 2)
    prefill = cost.prefill_time(max(0, shape.prompt_tokens - shape.cached_tokens))
    decode_bytes = new_tokens * (cost.step_base_s + cost.step_per_ctx_token_s * context)
    decode_compute = new_tokens * cost.step_per_seq_s * batch
    return (prefill, decode_bytes, decode_compute)


def corrected(cost: StepCost, values: tuple[float, ...]) -> StepCost:
    """``cost`` with its terms scaled by the fitted corrections."""
    prefill, decode_bytes, decode_compute = values
    return StepCost(
        prefill_s_per_token=cost.prefill_s_per_token * prefill,
        step_base_s=cost.step_base_s * decode_bytes,
        step_per_seq_s=cost.step_per_seq_s * decode_compute,
        step_per_ctx_token_s=cost.step_per_ctx_token_s * decode_bytes,
    )


@dataclass(slots=True)
class _Pending:
    instance: str
    shape: CallShape
    sent: float


class CostFit:
    """Per-instance corrections of the prior step cost, from the calls observed."""

    def __init__(
        self, *, window: int = 64, min_observations: int = 4, prior_weight: float = 1e-3
    ) -> None:
        self._window = window
        # Weaker than the planner's pull: an instance sees many calls, of varied shapes.
        self._prior_weight = prior_weight
        self._min_observations = min_observations
        self._fits: dict[str, Corrections] = {}
        self._costs: dict[str, StepCost] = {}
        self._pending: dict[str, _Pending] = {}  # by trajectory: one call in flight each
        self._cached_until: dict[str, tuple[str, int]] = {}  # trajectory: (instance, tokens)

    def cost(self, instance: Instance) -> StepCost:
        """What a step really costs on ``instance``: the prior until it has been observed."""
        return self._costs.get(instance.name, instance.cost)

    def corrections(self, name: str) -> tuple[float, ...]:
        fit = self._fits.get(name)
        return fit.values if fit is not None else (1.0, 1.0, 1.0)

    def sent(self, request: RouteRequest, route: Route) -> None:
        """The call is on its way (after the router counted it)."""
        now = _now()
        instance = route.instance
        if now is None or instance is None:
            return  # no event loop (a replayed history): nothing to time
        if instance.in_flight > instance.capacity:
            return  # it waits for a batch slot: its time would say more of the load than
            # of the server, and the rules price load apart
        name, context = instance.name, request.context_tokens
        last = self._cached_until.get(request.trajectory_id)
        cached = min(last[1], context) if last is not None and last[0] == name else 0
        shape = CallShape(context, cached, max(1, instance.in_flight))
        self._pending[request.trajectory_id] = _Pending(name, shape, now)

    def released(
        self, route: Route, *, outcome: CallOutcome, new_tokens: int, prior: StepCost
    ) -> None:
        pending = self._pending.pop(route.trajectory_id, None)
        now = _now()
        if pending is None or now is None or outcome != "ok" or new_tokens <= 0:
            return  # only a whole answer tells what a call costs
        shape = pending.shape
        end = shape.prompt_tokens + new_tokens
        self._cached_until[route.trajectory_id] = (pending.instance, end)
        self.observe(pending.instance, prior, shape, new_tokens, now - pending.sent)

    def observe(
        self, name: str, prior: StepCost, shape: CallShape, new_tokens: int, seconds: float
    ) -> None:
        """One call of ``shape`` on ``name`` sampled ``new_tokens`` in ``seconds``."""
        fit = self._fits.get(name)
        if fit is None:
            fit = self._fits[name] = Corrections(
                3, window=self._window, prior_weight=self._prior_weight
            )
        fit.add(call_terms(prior, shape, new_tokens), seconds)
        if fit.observations >= self._min_observations:
            self._costs[name] = corrected(prior, fit.values)

    def forget(self, trajectory_id: str) -> None:
        self._pending.pop(trajectory_id, None)
        self._cached_until.pop(trajectory_id, None)


def _now() -> float | None:
    """The event loop's clock (virtual under a mock clock); None outside any loop."""
    try:
        now = anyio.current_time()
    except RuntimeError:
        return None
    return now if math.isfinite(now) else None
