"""The scheduler's online cost fit: from the prior towards what the calls really cost."""

from __future__ import annotations

import random

from libra.fleet import StepCost
from libra.sched.policies._fit import CallShape, CostFit, call_terms, corrected

PRIOR = StepCost.for_tp(4)
#: What the instance really plays: prefill 1.4x, weights and KV read 1.6x slower, and
#: the per-sequence compute 0.9x the prior's.
TRUTH = corrected(PRIOR, (1.4, 1.6, 0.9))


def _calls(count: int, seed: int = 0) -> list[tuple[CallShape, int]]:
    rng = random.Random(seed)
    calls = []
    for _ in range(count):
        prompt = rng.randint(500, 30_000)
        cached = rng.choice([0, prompt // 2, prompt - 200])
        calls.append((CallShape(prompt, cached, rng.randint(1, 64)), rng.randint(20, 2_000)))
    return calls


def test_the_fit_starts_from_the_prior_and_converges_to_the_truth() -> None:
    fit = CostFit(window=64, min_observations=4)
    assert fit.corrections("tp4") == (1.0, 1.0, 1.0)
    for shape, new_tokens in _calls(64):
        seconds = sum(call_terms(TRUTH, shape, new_tokens))
        fit.observe("tp4", PRIOR, shape, new_tokens, seconds)
    values = fit.corrections("tp4")
    for got, want in zip(values, (1.4, 1.6, 0.9), strict=True):
        assert abs(got - want) < 0.05 * want
    learnt = fit._costs["tp4"]
    for batch in (1, 32, 256):
        truth = TRUTH.step_time(batch, batch * 8_000)
        assert abs(learnt.step_time(batch, batch * 8_000) - truth) < 0.05 * truth


def test_noisy_calls_still_move_the_cost_towards_the_truth() -> None:
    fit = CostFit(window=64, min_observations=4)
    rng = random.Random(1)
    for shape, new_tokens in _calls(200, seed=2):
        seconds = sum(call_terms(TRUTH, shape, new_tokens)) * rng.lognormvariate(0.0, 0.2)
        fit.observe("tp4", PRIOR, shape, new_tokens, seconds)
    learnt = fit._costs["tp4"]
    truth = TRUTH.step_time(16, 16 * 8_000)
    prior = PRIOR.step_time(16, 16 * 8_000)
    assert abs(learnt.step_time(16, 16 * 8_000) - truth) < 0.25 * abs(prior - truth)


def test_few_observations_keep_the_prior() -> None:
    fit = CostFit(min_observations=4)
    shape, new_tokens = _calls(1)[0]
    fit.observe("tp4", PRIOR, shape, new_tokens, 10 * sum(call_terms(PRIOR, shape, new_tokens)))
    assert "tp4" not in fit._costs
